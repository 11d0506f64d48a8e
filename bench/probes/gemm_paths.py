"""The fp32 GEMM paths a CPU linear layer can take (replica/layers/cpu_gemm.py), timed on the
default model's four linear shapes (SmolLM2-135M: qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536) x 30 layers, random weights, per row count: MKL's packed sgemm, oneDNN's packed
matmul, and unpacked F.linear. Inputs are made once per row count; the paths run interleaved,
minimum of the rounds. Shows which packing `STEPSERVE_CPU_GEMM=auto` should pick on this CPU.

Run: .venv/bin/python bench/probes/gemm_paths.py [--threads 2] [--rows 1,16,32,64,128,256,512]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replica.layers import cpu_gemm, cpu_isa  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,16,32,64,128,256,512")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", help="write the table as JSON to bench/results/<out>.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    paths = {}
    if cpu_gemm.mkl_library() is not None:
        packed = [[cpu_gemm.mkl_pack(w) for w in layer] for layer in weights]
        paths["mkl"] = lambda x, i, j, packed=packed: cpu_gemm.mkl_linear(
            x, packed[i][j], SHAPES[j][0], None
        )
    if torch.backends.mkldnn.is_available():
        reordered = [
            [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights
        ]
        paths["onednn"] = lambda x, i, j, r=reordered: torch.ops.mkldnn._linear_pointwise(
            x, r[i][j], None, "none", [], ""
        )
    paths["F.linear"] = lambda x, i, j: torch.nn.functional.linear(x, weights[i][j])
    print(f"{cpu_isa.cpu_model()} ({cpu_isa.cpu_vendor()}), {args.threads} thread(s); auto picks "
          f"{cpu_gemm.fp32_packing()}; ms for {LAYERS} layers (GFLOP/s), min of {args.rounds}")  # fmt: skip
    table = {}
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k) for _, k in SHAPES]
        flops = 2 * rows * sum(n * k for n, k in SHAPES) * LAYERS
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(args.rounds + 1):  # the first round warms up, and counts only if faster
            for name, fn in paths.items():
                start = time.perf_counter()
                for i in range(LAYERS):
                    for j in range(len(SHAPES)):
                        fn(xs[j], i, j)
                best[name] = min(best[name], time.perf_counter() - start)
        table[rows] = {name: round(t * 1e3, 2) for name, t in best.items()}
        cells = "  ".join(f"{n} {t * 1e3:7.1f} ({flops / t / 1e9:4.0f})" for n, t in best.items())
        print(f"{rows:5d} rows  {cells}", flush=True)
    if args.out:
        out = ROOT / "bench" / "results" / f"{args.out}.json"
        meta = {"cpu": cpu_isa.cpu_model(), "vendor": cpu_isa.cpu_vendor()}
        out.write_text(json.dumps({**meta, "threads": args.threads, "ms": table}, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
