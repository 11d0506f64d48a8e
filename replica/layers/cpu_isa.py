"""Which x86-64 instruction sets the CPU code paths may use, decided from the CPU's features.

Levels, lowest first (each includes the ones before it):
  portable     x86-64 baseline (SSE2): runs on any x86-64 CPU
  avx2         x86-64-v3: AVX2, FMA, F16C (Haswell / Zen and later)
  avx512       x86-64-v4: AVX-512 F/BW/VL/DQ/CD (Skylake-SP / Zen 4 and later)
  avx512_vnni  avx512 plus AVX512_VNNI (Cascade Lake / Ice Lake): the quantized kernels' int8
               dot products take vpdpbusd / vpdpwssd (nothing else of ours differs from avx512)
  avx512_bf16  avx512_vnni plus AVX512_BF16 (Cooper Lake / Sapphire Rapids / Zen 4)

The level in use is the CPU's own, capped by `STEPSERVE_CPU_ISA` (one of the names above, or
`auto`; read once per process) so that every path can be run on a host that has a higher one: the native kernels are
compiled for that level (`-march=x86-64-v3` and so on) and oneDNN's bf16 weight packing is used
only where the level (or the CPU's AVX-NE-CONVERT) allows it (cpu_gemm.py: the GEMM per dtype).
AMX is no level of its own: oneDNN's bf16 GEMM picks AMX tiles or AVX512-BF16 itself, nothing
of ours decides between them (ONEDNN_MAX_CPU_ISA caps it, as the tests do). On other architectures there is
one level, `native`. The choice is logged once per process and level.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

ISA_ENV = "STEPSERVE_CPU_ISA"
X86_LEVELS = ("portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16")
NATIVE = "native"  # the one level of a non-x86 CPU
# /proc/cpuinfo flags each level needs beyond the one below it
_LEVEL_FLAGS = {
    "portable": frozenset(),
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi2"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
    "avx512_vnni": frozenset({"avx512_vnni"}),
    "avx512_bf16": frozenset({"avx512_bf16"}),
}
# compiler flags per level; -mtune=native keeps the scheduling model of this CPU
_MARCH = {
    "portable": ("-march=x86-64", "-mtune=generic"),
    "avx2": ("-march=x86-64-v3", "-mtune=native"),
    "avx512": ("-march=x86-64-v4", "-mtune=native"),
    "avx512_vnni": ("-march=x86-64-v4", "-mavx512vnni", "-mtune=native"),
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=native"),
    NATIVE: ("-O3",),  # no -march: the architecture's baseline (NEON on aarch64)
}
# oneDNN refuses to pack bf16 weights below this unless the CPU has AVX-NE-CONVERT
_BF16_PACKING_LEVEL = "avx512"


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@lru_cache(maxsize=1)
def _cpuinfo_field(name: str) -> str | None:
    """The first value of `name` in /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    return frozenset((_cpuinfo_field("flags") or "").split())


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; else what the platform module says)."""
    return _cpuinfo_field("model name") or platform.processor()


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"; "" unknown)."""
    return _cpuinfo_field("vendor_id") or ""


def detected_level(flags: frozenset[str] | None = None) -> str:
    """The highest level this CPU (or the given flag set) can execute."""
    if not is_x86():
        return NATIVE
    flags = cpu_flags() if flags is None else flags
    best = "portable"
    for level in X86_LEVELS[1:]:
        if not _LEVEL_FLAGS[level] <= flags:
            break
        best = level
    return best


def levels() -> tuple[str, ...]:
    """Every level name of this architecture, lowest first."""
    return X86_LEVELS if is_x86() else (NATIVE,)


def runnable_levels() -> tuple[str, ...]:
    """The levels this CPU can execute, lowest first: the paths a test can run here."""
    if not is_x86():
        return (NATIVE,)
    return X86_LEVELS[: X86_LEVELS.index(detected_level()) + 1]


def levels_to_test() -> tuple[str, ...]:
    """`runnable_levels` less avx512 where avx512_vnni runs too: the two differ only in the
    quantized kernels' int8 dot products (which their tests run at every runnable level), so a
    test of the other paths runs the higher one, the CPU's own path, and costs no more time."""
    runnable = runnable_levels()
    return tuple(lv for lv in runnable if not (lv == "avx512" and "avx512_vnni" in runnable))


def missing_flags(level: str, flags: frozenset[str] | None = None) -> list[str]:
    """The instruction-set flags the CPU lacks for `level` (empty when it can run it)."""
    if level == NATIVE or not is_x86():
        return []
    flags = cpu_flags() if flags is None else flags
    needed: set[str] = set()
    for name in X86_LEVELS[: X86_LEVELS.index(level) + 1]:
        needed |= _LEVEL_FLAGS[name]
    return sorted(needed - flags)


def parse_cap(value: str | None) -> str | None:
    """A cap as written in STEPSERVE_CPU_ISA: None for unset/`auto`; ValueError naming the bad
    value and the allowed ones otherwise."""
    if value is None or value.strip().lower() in ("", "auto"):
        return None
    name = value.strip().lower()
    allowed = levels()
    if name not in allowed:
        raise ValueError(f"{ISA_ENV}={value!r} is not one of: auto, {', '.join(allowed)}")
    return name


class _ThreadLevel(threading.local):
    level: str | None = None  # set by `use_level` in this thread


_thread = _ThreadLevel()
_process_level: str | None = None  # level_from_env(), read once
_logged: set[str] = set()


def active_level() -> str:
    """The level the CPU code paths use now: a `use_level` of this thread, else the process's
    (the CPU's own capped by STEPSERVE_CPU_ISA, read once). Called per native-kernel call."""
    level = _thread.level
    if level is not None:
        return level
    global _process_level
    if _process_level is None:
        _process_level = level_from_env()
    return _process_level


def level_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The CPU's own level capped by STEPSERVE_CPU_ISA in `environ` (default: this process's);
    a cap above the CPU's level is the CPU's level."""
    environ = os.environ if environ is None else environ
    return _effective(parse_cap(environ.get(ISA_ENV)))


def level_for(cap: str) -> str:
    """The level an engine whose `cpu_isa` is `cap` runs at: auto is the process's level
    (`active_level`), any other cap lowers the CPU's own level (never raises it)."""
    if cap == "auto":
        return active_level()
    return _effective(parse_cap(cap))


def _effective(cap: str | None) -> str:
    detected = detected_level()
    if cap is None or detected == NATIVE:
        return detected
    return X86_LEVELS[min(X86_LEVELS.index(cap), X86_LEVELS.index(detected))]


def check_runnable(level: str) -> str:
    """`level` if this CPU can execute it, else ValueError naming what it lacks."""
    if level not in runnable_levels():
        raise ValueError(
            f"this CPU cannot run level {level!r}: it lacks {', '.join(missing_flags(level))}"
        )
    return level


class use_level:
    """Context manager: run the CPU code paths of this thread at `level` (must be runnable
    here): what a runner does around its steps for its engine's `cpu_isa`, and what tests do
    to run every path. Nests; other threads keep theirs."""

    def __init__(self, level: str) -> None:
        self.level = check_runnable(level)
        self._saved: str | None = None

    def __enter__(self) -> str:
        self._saved = _thread.level
        _thread.level = self.level
        return self.level

    def __exit__(self, *exc) -> None:
        _thread.level = self._saved


def march_flags(level: str) -> tuple[str, ...]:
    """Compiler flags that target `level`."""
    return _MARCH[level]


def onednn_bf16_packing(level: str | None = None, flags: frozenset[str] | None = None) -> bool:
    """Whether oneDNN may pack bf16 linear weights at this level: it needs AVX-512 BW/VL/DQ (or
    AVX-NE-CONVERT), else it raises from deep inside the reorder."""
    level = active_level() if level is None else level
    if level == NATIVE:
        return False  # oneDNN's bf16 reorder is x86-only
    flags = cpu_flags() if flags is None else flags
    at_least = X86_LEVELS.index(level) >= X86_LEVELS.index(_BF16_PACKING_LEVEL)
    return at_least or ("avx_ne_convert" in flags and level != "portable")


def describe(level: str | None = None, fp32_gemm: str | None = None) -> str:
    """One line: the level, what the CPU has, the cap and what follows from them; `fp32_gemm` is
    cpu_gemm.fp32_packing()'s answer (the caller asks it: cpu_gemm depends on this module)."""
    level = active_level() if level is None else level
    detected = detected_level()
    cap = os.environ.get(ISA_ENV)
    bf16_pack = onednn_bf16_packing(level)
    parts = [
        f"CPU instruction set level {level!r}",
        f"(CPU: {detected}"
        + (f", capped by {ISA_ENV}={cap}" if cap and level != detected else "")
        + ")",
        f"native kernels built with {' '.join(march_flags(level))}",
        f"fp32 weights packed for {_FP32_GEMM_NAMES.get(fp32_gemm, 'nothing (F.linear)')}",
        f"bf16 weights packed for oneDNN ({_bf16_units(level)})"
        if bf16_pack
        else "bf16 weights stay row-major (F.linear): packing them for oneDNN needs AVX-512 "
        "BW/VL/DQ or AVX-NE-CONVERT",
    ]
    return ", ".join(parts)


def _bf16_units(level: str) -> str:
    """What oneDNN's bf16 GEMM runs on here: it picks AMX tiles or AVX512-BF16 itself (no level
    of ours decides between them; ONEDNN_MAX_CPU_ISA caps it)."""
    flags = cpu_flags()
    if level == "avx512_bf16" and {"amx_bf16", "amx_tile"} <= flags:
        return "AMX tiles"
    if level == "avx512_bf16":
        return "AVX512-BF16"
    return "bf16 converted to fp32 in AVX-512 registers"


_FP32_GEMM_NAMES = {"mkl": "MKL's packed sgemm", "onednn": "oneDNN"}


def log_choice(level: str | None = None, fp32_gemm: str | None = None) -> None:
    """Log `describe` once per process and level."""
    level = active_level() if level is None else level
    if level not in _logged:
        _logged.add(level)
        logger.info("%s", describe(level, fp32_gemm))
