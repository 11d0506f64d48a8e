"""The prefill attention kernel (replica/layers/csrc/paged_prefill.c) of a git revision against
the working tree's, both built here with the engine's flags for one instruction-set level and
timed in one process, interleaved (minimum of the rounds), on SmolLM2's attention (9 query / 3
KV heads of 64, blocks of 16); each shape's rows of the two builds compared.

    python bench/probes/prefill_kernel_ab.py --rev HEAD~1 [--threads 1] [--level avx512]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replica.layers import cpu_isa  # noqa: E402
from replica.layers.cpu_kernels import CFLAGS, OPENMP, _compiler  # noqa: E402
from tests.replica.test_prefill_kernel import spans_case  # noqa: E402

CSRC = "replica/layers/csrc"
SHAPES = {
    "128-token prompt": [(0, 128)],
    "4 x 128-token prompts": [(0, 128)] * 4,
    "512-token prompt": [(0, 512)],
    "2048-token prompt": [(0, 2048)],
    "256-token chunk after 1024 cached": [(1024, 256)],
}


def build(source_dir: Path, level: str, out: Path) -> ctypes.CDLL:
    flags = [*CFLAGS, *cpu_isa.march_flags(level), *OPENMP, "-shared", "-pthread"]
    cmd = [_compiler(), *flags, "-o", str(out), str(source_dir / "paged_prefill.c"), "-lm"]
    subprocess.run(cmd + ["-lmvec"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    # the tree since session 56 takes q's row stride after q
    lib.strided = "q_stride" in (source_dir / "paged_prefill.c").read_text()
    return lib


def checkout(rev: str, into: Path) -> Path:
    """The revision's kernel sources (the .c and the headers it includes) in a directory."""
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, f"{CSRC}/"], cwd=ROOT, check=True,
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    into.mkdir(parents=True)
    for name in names:
        if name.endswith((".c", ".h")):
            text = subprocess.run(
                ["git", "show", f"{rev}:{name}"], cwd=ROOT, check=True, capture_output=True
            ).stdout
            (into / Path(name).name).write_bytes(text)
    return into


def call(lib, case, threads: int, out: torch.Tensor) -> None:
    q, k, v, table, starts, lens, ctx = case
    p = ctypes.c_void_p
    stride = [ctypes.c_int64(q.stride(0))] if lib.strided else []
    status = lib.stepserve_paged_prefill(
        p(q.data_ptr()), *stride, p(k.data_ptr()), p(v.data_ptr()), p(table.data_ptr()),
        p(starts.data_ptr()), p(lens.data_ptr()), p(ctx.data_ptr()), p(out.data_ptr()),
        table.shape[0], q.shape[1], k.shape[2], q.shape[2], k.shape[1], table.shape[1],
        ctypes.c_float(q.shape[2] ** -0.5), 0, threads, 0, ctypes.c_float(0.0),
    )  # fmt: skip
    if status:
        raise MemoryError("the kernel could not allocate its scratch")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD", help="the git revision to compare with the tree")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--level", default=None, help="instruction-set level (default: the CPU's)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    level = args.level or cpu_isa.active_level()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {
            args.rev: build(checkout(args.rev, Path(tmp) / "rev"), level, Path(tmp) / "rev.so"),
            "tree": build(ROOT / CSRC, level, Path(tmp) / "tree.so"),
        }
        print(f"level {level}, {args.threads} thread(s); ms (GFLOP/s), minimum of the rounds")
        for name, spans in SHAPES.items():
            case = spans_case(0, spans, 9, 3, 64, 16, torch.float32)
            flop = sum(4 * n * (c + n / 2) * 64 * 9 for c, n in spans)  # causal QK^T and PV
            reps = max(3, int(2e8 / flop))
            best = dict.fromkeys(libs, float("inf"))
            outs = {}
            for _ in range(args.rounds):
                for label, lib in libs.items():
                    out = torch.zeros_like(case[0])
                    started = time.perf_counter()
                    for _ in range(reps):
                        call(lib, case, args.threads, out)
                    best[label] = min(best[label], (time.perf_counter() - started) / reps)
                    outs[label] = out
            diff = float((outs["tree"] - outs[args.rev]).abs().max())
            cells = "  ".join(
                f"{label} {best[label] * 1e3:7.3f} ({flop / best[label] / 1e9:5.1f})"
                for label in libs
            )
            ratio = best[args.rev] / best["tree"]
            print(f"{name:34} {cells}  tree {ratio:.2f}x faster, max |diff| {diff:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
