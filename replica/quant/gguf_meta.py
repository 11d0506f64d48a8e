"""GGUF checkpoints' metadata side. On the `qload` branch only `gguf_file_of` (the metadata work
replaces this file with the sidecar builder, model-path resolution and more)."""

from __future__ import annotations

import json
from pathlib import Path

SIDECAR_FILE = "gguf.json"


def gguf_file_of(model_dir: str | Path) -> Path | None:
    """The GGUF file a sidecar model directory names in gguf.json ({"gguf_file": path}), or None
    for an ordinary (safetensors) model directory."""
    sidecar = Path(model_dir) / SIDECAR_FILE
    if not sidecar.is_file():
        return None
    try:
        return Path(json.loads(sidecar.read_text())["gguf_file"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{sidecar} is not a valid GGUF sidecar: {exc}") from exc
