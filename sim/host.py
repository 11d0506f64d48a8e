"""The host a profile is measured on: how busy it was while the profile ran (load average, CPU
used by other processes, steal) and which CPU it is, so that a profile taken on a busy host is
refused or flagged and a profile used on a different CPU is warned about."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# a host counts as busy when, over the measurement, other processes used more than this many
# cores on average (or this share of the host, whichever is more), or the hypervisor stole more
# than STEAL_LIMIT of the CPU time
OTHER_CORES_LIMIT = 0.25
OTHER_SHARE_LIMIT = 0.10
STEAL_LIMIT = 0.05


@dataclass(frozen=True)
class CpuTimes:
    """One reading of /proc/stat's `cpu` line (seconds, summed over cores), this process's CPU
    seconds (os.times: its threads and waited-for children) and the load average."""

    wall: float
    busy: float  # user + nice + system + irq + softirq
    idle: float  # idle + iowait
    steal: float
    own: float
    loadavg: tuple[float, float, float]

    @classmethod
    def now(cls, proc: Path = Path("/proc")) -> CpuTimes:
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy = idle = steal = 0.0
        try:
            fields = (proc / "stat").read_text().splitlines()[0].split()[1:]
            v = [float(x) / hz for x in fields] + [0.0] * 10
            busy = v[0] + v[1] + v[2] + v[5] + v[6]
            idle = v[3] + v[4]
            steal = v[7]
        except (OSError, IndexError, ValueError):
            pass
        try:
            load = tuple(float(x) for x in (proc / "loadavg").read_text().split()[:3])
        except (OSError, ValueError):
            load = (0.0, 0.0, 0.0)
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return cls(time.monotonic(), busy, idle, steal, own, load)  # type: ignore[arg-type]


def host_load(start: CpuTimes, end: CpuTimes, cpus: int | None = None) -> dict:
    """What the host did between two readings: the load average at both ends, the share of CPU
    time busy, idle and stolen, and the cores other processes used on average (busy less this
    process's own CPU), with the verdict `busy` and why."""
    cpus = cpus or os.cpu_count() or 1
    wall = max(end.wall - start.wall, 1e-9)
    busy = end.busy - start.busy
    idle = end.idle - start.idle
    steal = end.steal - start.steal
    total = max(busy + idle + steal, 1e-9)
    other_cores = max(0.0, busy - (end.own - start.own)) / wall
    reasons = []
    if other_cores > max(OTHER_CORES_LIMIT, OTHER_SHARE_LIMIT * cpus):
        reasons.append(f"other processes used {other_cores:.2f} of {cpus} cores")
    if steal / total > STEAL_LIMIT:
        reasons.append(f"{steal / total:.1%} of CPU time stolen by the hypervisor")
    return {
        "cpus": cpus,
        "seconds": round(wall, 2),
        "loadavg_start": list(start.loadavg),
        "loadavg_end": list(end.loadavg),
        "busy_share": round(busy / total, 4),
        "idle_share": round(idle / total, 4),
        "steal_share": round(steal / total, 4),
        "other_cores": round(other_cores, 3),
        "busy": bool(reasons),
        "busy_reason": "; ".join(reasons),
    }


def check_quiet(seconds: float = 3.0, sleep=time.sleep) -> dict:
    """The host's load over `seconds` of this process doing nothing (host_load's dict)."""
    start = CpuTimes.now()
    sleep(seconds)
    return host_load(start, CpuTimes.now())


def cpu_identity() -> dict:
    """The CPU the profile runs on: model name, the ISA level its kernels use and the highest
    level the CPU has."""
    from replica.layers import cpu_isa

    return {
        "processor": cpu_isa.cpu_model(),
        "cpu_isa": cpu_isa.active_level(),
        "cpu_isa_detected": cpu_isa.detected_level(),
    }


def cpu_mismatch(meta: dict, here: dict | None = None) -> list[str]:
    """Why a profile (its `meta`) may not price this host's steps: a different CPU model or
    ISA level. Empty when they agree."""
    here = here or cpu_identity()
    out = []
    if meta.get("processor") and meta["processor"] != here["processor"]:
        out.append(f"profile measured on {meta['processor']!r}, this host is {here['processor']!r}")
    if meta.get("cpu_isa") and meta["cpu_isa"] != here["cpu_isa"]:
        out.append(
            f"profile's kernels ran at ISA level {meta['cpu_isa']!r}, this host's run at "
            f"{here['cpu_isa']!r}"
        )
    return out
