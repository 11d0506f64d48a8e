"""stepserve's cache directory on this machine (STEPSERVE_CACHE, else ~/.cache/stepserve): the
default model's de-quantized copy, GGUF metadata directories, built C kernels, helper binaries."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "STEPSERVE_CACHE"


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "stepserve"
