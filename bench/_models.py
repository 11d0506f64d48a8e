"""Models the benchmarks run: the tests' tiny random Llama (built once into the stepserve cache,
with a longer context than the tests use) or the converted default model."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from replica.tiny_models import BENCH_TINY_FIELDS as TINY_FIELDS  # noqa: E402,F401


def model_dir(name: str) -> Path:
    """`tiny`, `default` (SmolLM2-135M-Instruct in fp32), `default-gguf` (as served: Q4_1) or a
    path to a local HF directory or GGUF file (replica/tiny_models.py resolve_model_dir)."""
    from replica.tiny_models import resolve_model_dir

    try:
        return resolve_model_dir(name)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
