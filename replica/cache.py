"""stepserve's cache directory on this machine (STEPSERVE_CACHE, else ~/.cache/stepserve): the
default model's de-quantized copy, GGUF metadata directories, built C kernels, helper binaries."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "STEPSERVE_CACHE"


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "stepserve"


def build_once(target: Path, done: str, build: Callable[[Path], None]) -> Path:
    """`target`, made once and atomically: `build(tmp)` fills a fresh sibling directory, which
    is then renamed into place; a directory holding the file `done` (build writes it last) is
    complete. Of concurrent builders one wins the rename and the others use its directory; a
    stale partial directory in the way is replaced."""
    if (target / done).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            tmp.rename(target)
        except OSError:
            if (target / done).exists():  # another process finished first
                return target
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
