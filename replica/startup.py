"""How long this process has run: the start-up reports (a replica's boot and imports before its
constructor, `stepserve serve`'s time to ready) count from the process's own start."""

from __future__ import annotations

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
