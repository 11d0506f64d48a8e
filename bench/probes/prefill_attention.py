"""Prefill attention on the CPU: the native tiled kernel (csrc/paged_prefill.c) against the
torch SDPA path it replaces (torch_sdpa.attend_prefills: one causal SDPA call per request over
its keys gathered from the paged cache), side by side in one process, per shape. fp32,
SmolLM2-135M's attention (9 query heads, 3 KV heads of 64), blocks of 16.

    python bench/probes/prefill_attention.py [--threads 2] [--reps 15] [--isa avx2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from replica.layers.cpu_isa import use_level  # noqa: E402
from replica.layers.cpu_kernels import paged_prefill  # noqa: E402
from tests.replica.test_prefill_kernel import spans_case  # noqa: E402

SHAPES = {  # name: (context before, query tokens) per request
    "146-token prompt": [(0, 146)],
    "4 x 128-token prompts": [(0, 128)] * 4,
    "512-token prompt": [(0, 512)],
    "2048-token prompt": [(0, 2048)],
    "256-token chunk after 1024 cached": [(1024, 256)],
    "4096-token prompt": [(0, 4096)],
    "256-token chunk after 3840 cached": [(3840, 256)],
    "256-token chunk after 7936 cached": [(7936, 256)],
}


def sdpa_path(q, k, v, table, starts, lens, ctx, scale):
    """What the torch path does per request: a whole prompt attends its own new K/V (causal),
    a chunk after context gathers its keys from the cache (bottom-right mask)."""
    block_size = k.shape[1]
    flat_k, flat_v = k.view(-1, k.shape[2], k.shape[3]), v.view(-1, v.shape[2], v.shape[3])
    out = torch.empty_like(q)
    for s, (q0, n, c) in enumerate(zip(starts.tolist(), lens.tolist(), ctx.tolist())):
        keys = torch.arange(c + n)
        slots = table[s].long()[keys // block_size] * block_size + keys % block_size
        kp, vp = flat_k.index_select(0, slots), flat_v.index_select(0, slots)
        mask = None if c == 0 else torch.ones(n, c + n, dtype=torch.bool).tril(diagonal=c)
        o = F.scaled_dot_product_attention(
            q[q0 : q0 + n].transpose(0, 1).unsqueeze(0), kp.transpose(0, 1).unsqueeze(0),
            vp.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
            scale=scale, enable_gqa=True,
        )  # fmt: skip
        out[q0 : q0 + n] = o[0].transpose(0, 1)
    return out


def median_s(fn, args: tuple, reps: int) -> float:
    fn(*args)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--isa", default=None, help="instruction-set level (default: the CPU's)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with use_level(args.isa) if args.isa else contextlib.nullcontext():
        for name, spans in SHAPES.items():
            case = spans_case(0, spans, 9, 3, 64, 16, torch.float32)
            torch_s = median_s(sdpa_path, (*case, 0.125), args.reps)
            native_s = median_s(paged_prefill, (*case, 0.125), args.reps)
            flop = sum(4 * n * (c + n / 2) * 64 * 9 for c, n in spans)  # causal QK^T and PV
            row = {"shape": name, "torch_ms": round(torch_s * 1e3, 2),
                   "native_ms": round(native_s * 1e3, 2),
                   "torch_gflops": round(flop / torch_s / 1e9, 1),
                   "native_gflops": round(flop / native_s / 1e9, 1),
                   "speedup": round(torch_s / native_s, 2)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
