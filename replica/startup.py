"""How long this process has run: the start-up reports (a replica's boot and imports before its
constructor, `stepserve serve`'s time to ready) count from the process's own start. And the end
of a serving process's start: its heap frozen out of the garbage collector's reach."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime: ticks after boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def freeze_heap() -> None:
    """Leave every object alive now out of the garbage collector's later passes (`gc.freeze`).
    A serving process (ingress, replica front, engine core) holds a few hundred thousand objects
    from its imports (torch, Ray, transformers): a full collection over them took ~0.2 s in an
    ingress-like process, a stall for whatever request was passing through (the TTFT outliers
    of an idle server). Objects made later are collected as usual; the ones frozen are never
    freed, so call this where a process has finished starting (again after a late import)."""
    gc.freeze()
