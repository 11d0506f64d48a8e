"""The quantized matmul kernels (replica/layers/csrc/quant_gemm.c) on the linear shapes of
SmolLM2-135M, against an fp32 weight packed for oneDNN (PackableLinear's path) in the same run:

  per shape (N x K) and rows of x M: microseconds per call and GB/s of weight streamed for
    q-int8   the kernel, int8 activations          (--types, default Q4_1 and Q8_0)
    q-fp32   the kernel, fp32 activations (parity)
    dq-gemm  the weight de-quantized to fp32 in tiles + torch's GEMM (the large-M path)
    fp32     oneDNN-packed fp32 weight (_linear_pointwise), the engine's float path
  and the ratios of the times (fp32 / q-int8 above 1: the quantized kernel is faster than the
  float engine's linear; dq-gemm / q-* above 1: the kernel is ahead of the large-M path, where
  kernels.CROSSOVER_M switches).

Each configuration cycles through distinct copies of its weight totalling --stream-mb, so that
the weights come from memory as in a real forward (a model's weights do not fit the caches),
not from the caches; the figure is the best of --repeats timed passes. GB/s counts the weight's
own bytes (quantized bytes for q-*, fp32 bytes for fp32).

With --model: the linear layers of one SmolLM2-135M (Q4_1 GGUF) decode step instead, through
quant_matmul as the engine calls it (30 layers of distinct weights, the Q8_0 lm_head).

Run: .venv/bin/python bench/quant_kernels.py [--threads 2] [--levels avx512,avx512_vnni]
     [--rounds 3] [--types Q4_1,Q8_0] [--ms 1,4,16,64,256] [--model]
     [--clock thread (with --threads 1)]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from replica.layers import cpu_isa, cpu_kernels  # noqa: E402
from replica.quant import kernels  # noqa: E402
from replica.quant.formats import BLOCK, QType, QuantizedTensor  # noqa: E402

# SmolLM2-135M: q/o (576x576), k/v (192x576), gate/up (1536x576), down (576x1536); the tied
# embedding / lm_head is Q8_0 in the GGUF file
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
LM_HEAD = (49152, 576)
PATHS = ("q-int8", "q-fp32", "dq-gemm", "fp32")


def random_weight(qtype: QType, n: int, k: int, gen: torch.Generator) -> QuantizedTensor:
    """Random block bytes with small sane fp16 scales (the kernels' speed does not depend on
    the values)."""
    elems, nbytes = BLOCK[qtype]
    nb = k // elems
    data = torch.randint(0, 256, (n, nb, nbytes), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, nb, 1, generator=gen) * 0.01 + 1e-3).half().view(torch.uint8)
    at = {QType.Q6_K: [208]}.get(
        qtype, [0, 2] if qtype in (QType.Q4_1, QType.Q4_K, QType.Q5_K) else [0]
    )
    for off in at:
        data[:, :, off : off + 2] = scale
    return QuantizedTensor(qtype, (n, k), data.reshape(n, -1))


CLOCK = time.perf_counter  # --clock thread: time.thread_time (1 thread on a shared host)


def best_time(fn, calls: int, repeats: int) -> float:
    """Seconds per call: the best of `repeats` passes of `calls` calls."""
    fn(0)
    best = float("inf")
    for _ in range(repeats):
        start = CLOCK()
        for i in range(calls):
            fn(i)
        best = min(best, (CLOCK() - start) / calls)
    return best


def best_times(fns: dict, repeats: int) -> dict[str, float]:
    """best_time of each (fn, calls), the passes of the paths interleaved (a busy moment of a
    shared host then hits them alike, and the minimum drops it)."""
    best = {name: float("inf") for name in fns}
    for fn, _ in fns.values():
        fn(0)
    for _ in range(repeats):
        for name, (fn, calls) in fns.items():
            best[name] = min(best[name], best_time_once(fn, calls))
    return best


def best_time_once(fn, calls: int) -> float:
    start = CLOCK()
    for i in range(calls):
        fn(i)
    return (CLOCK() - start) / calls


def copies_for(nbytes: int, stream_mb: float) -> int:
    return max(1, int(stream_mb * 2**20 // nbytes) + 1)


def bench_shape(n, k, qtypes, ms, stream_mb, repeats, gen, lib, paths=PATHS):
    rows = []
    # fp32 packed baseline
    fp32_bytes = n * k * 4
    w32 = [
        torch.randn(n, k, generator=gen) * 0.02 for _ in range(copies_for(fp32_bytes, stream_mb))
    ]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in w32]
    del w32
    for qtype in qtypes:
        qbytes = n * k // BLOCK[qtype][0] * BLOCK[qtype][1]
        ws = [random_weight(qtype, n, k, gen) for _ in range(copies_for(qbytes, stream_mb))]
        for m in ms:
            x = torch.randn(m, k, generator=gen)
            out = torch.empty(m, n)
            xp = x if m >= 4 else torch.nn.functional.pad(x, (0, 0, 0, 4 - m))
            calls = max(len(ws), 20)
            # path -> (one call, calls a pass); --paths picks some; timed interleaved
            fns = {
                "q-int8": (
                    lambda i, x=x, ws=ws, out=out: kernels._kernel(
                        lib, x, ws[i % len(ws)], out, None, True
                    ),
                    calls,
                ),
                "q-fp32": (
                    lambda i, x=x, ws=ws, out=out: kernels._kernel(
                        lib, x, ws[i % len(ws)], out, None, False
                    ),
                    calls,
                ),
                "dq-gemm": (
                    lambda i, x=x, ws=ws, out=out: kernels._dequant_gemm(
                        lib, x, ws[i % len(ws)], out
                    ),
                    max(len(ws), 5),
                ),
                "fp32": (
                    lambda i, xp=xp: torch.ops.mkldnn._linear_pointwise(
                        xp, packed[i % len(packed)], None, "none", [], ""
                    ),
                    max(len(packed), 20),
                ),
            }
            t = best_times({name: fns[name] for name in fns if name in paths}, repeats)
            rows.append((n, k, qtype.name, m, t, qbytes, fp32_bytes))
            line = f"{n:>5}x{k:<5} {qtype.name:<5} M={m:<4}"
            for name, sec in t.items():
                gbs = (fp32_bytes if name == "fp32" else qbytes) / sec / 1e9
                line += f" {name} {sec * 1e6:8.1f}us {gbs:5.1f}GB/s |"
            for a, b in (("fp32", "q-int8"), ("fp32", "q-fp32"), ("dq-gemm", "q-int8"),
                         ("dq-gemm", "q-fp32")):  # fmt: skip
                if a in t and b in t:
                    line += f" {a}/{b} {t[a] / t[b]:.2f}x"
            print(line, flush=True)
    return rows


def model_step(repeats: int, gen: torch.Generator) -> None:
    """The linear layers of one SmolLM2-135M decode step (30 layers, Q4_1, and the 49152-row
    Q8_0 lm_head), one row of x: q/k/v/o/gate/up/down as 7 calls per layer, merged qkv and gate_up
    as 4, in int8 and fp32 activations; and the same layers in fp32 packed for oneDNN."""
    layers = []
    for _ in range(30):
        q, k, v, o = (random_weight(QType.Q4_1, n, 576, gen) for n in (576, 192, 192, 576))
        gate, up = (random_weight(QType.Q4_1, 1536, 576, gen) for _ in range(2))
        down = random_weight(QType.Q4_1, 576, 1536, gen)
        cat = lambda *ws: QuantizedTensor(  # noqa: E731
            QType.Q4_1,
            (sum(w.shape[0] for w in ws), ws[0].shape[1]),
            torch.cat([w.data for w in ws]),
        )
        layers.append(((q, k, v, o, gate, up, down), (cat(q, k, v), o, cat(gate, up), down)))
    head = random_weight(QType.Q8_0, 49152, 576, gen)
    x576, x1536 = torch.randn(1, 576, generator=gen), torch.randn(1, 1536, generator=gen)

    def step(which: int, act: str) -> None:
        for ws in layers:
            for w in ws[which]:
                kernels.quant_matmul(x1536 if w.shape[1] == 1536 else x576, w, activations=act)
        kernels.quant_matmul(x576, head, activations=act)

    results = {}
    for which, name in ((0, "7 calls/layer"), (1, "4 calls/layer (merged qkv, gate_up)")):
        for act in kernels.ACTIVATIONS:
            results[f"{act}, {name}"] = best_time(lambda i, w=which, a=act: step(w, a), 10, repeats)
    packed = []
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]:
        packed.append(
            torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=gen) * 0.02)
        )
    xp576, xp1536 = (
        torch.nn.functional.pad(x576, (0, 0, 0, 3)),
        torch.nn.functional.pad(x1536, (0, 0, 0, 3)),
    )

    def fp32_step(i: int) -> None:
        for w in packed:
            x = xp1536 if w.size(1) == 1536 else xp576
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    results["fp32 oneDNN packed, 4 calls/layer"] = best_time(fp32_step, 5, repeats)
    print("SmolLM2-135M decode step, linear layers only (1 row of x):")
    for name, sec in results.items():
        print(f"  {name:<48} {sec * 1e3:7.2f} ms  ({1 / sec:6.0f} steps/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--levels", default=None, help="comma list (default: the CPU's level)")
    parser.add_argument("--types", default="Q4_1,Q8_0")
    parser.add_argument("--ms", default="1,4,16,64,256")
    parser.add_argument("--shapes", default=None, help="e.g. 576x576,49152x576 (default: all)")
    parser.add_argument("--stream-mb", type=float, default=96.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run --levels in turn this many times (an interleaved A/B on a shared host); with "
        "several levels the best of each is compared at the end",
    )
    parser.add_argument("--model", action="store_true", help="only the SmolLM2-135M decode step")
    parser.add_argument("--paths", default=",".join(PATHS), help="of " + ",".join(PATHS))
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: this thread's CPU time (fair on a busy host with --threads 1 only)",
    )
    args = parser.parse_args()
    global CLOCK
    if args.clock == "thread":
        if args.threads != 1:
            parser.error("--clock thread counts the calling thread only: use it with --threads 1")
        CLOCK = time.thread_time
    torch.set_num_threads(args.threads)
    levels = args.levels.split(",") if args.levels else [cpu_isa.detected_level()]
    qtypes = [QType[t] for t in args.types.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    shapes = (
        [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        if args.shapes
        else SHAPES
    )
    print(f"{cpu_isa.cpu_model()}, {args.threads} threads, torch {torch.__version__}")
    gen = torch.Generator().manual_seed(0)
    # level -> (n, k, type, M, path) -> best seconds over the rounds
    best: dict[str, dict[tuple, float]] = {}
    for _ in range(args.rounds):
        for level in levels:
            with cpu_isa.use_level(level):
                lib = cpu_kernels.native_library()
                print(f"== level {level} (kernel path {lib.stepserve_quant_isa()})")
                if args.model:
                    model_step(args.repeats, gen)
                    continue
                for n, k in shapes:
                    types = [QType.Q8_0] if (n, k) == LM_HEAD else qtypes
                    rows = bench_shape(
                        n,
                        k,
                        types,
                        ms,
                        args.stream_mb,
                        args.repeats,
                        gen,
                        lib,
                        args.paths.split(","),
                    )
                    for n_, k_, qname, m, t, *_ in rows:
                        for path, sec in t.items():
                            key = (n_, k_, qname, m, path)
                            mine = best.setdefault(level, {})
                            mine[key] = min(mine.get(key, float("inf")), sec)
    if len(best) > 1:
        compare_levels(best, args.rounds)


def compare_levels(best: dict[str, dict[tuple, float]], rounds: int) -> None:
    """Per configuration, each level's best time over the rounds and the first level's time over
    each other's (above 1: the other level is faster)."""
    first, *others = best
    print(f"== best of {rounds} round(s), us per call; {first} / other level")
    for key, base in best[first].items():
        n, k, qname, m, path = key
        line = f"{n:>5}x{k:<5} {qname:<5} M={m:<4} {path:<8} {first} {base * 1e6:8.1f}"
        for level in others:
            sec = best[level][key]
            line += f" | {level} {sec * 1e6:8.1f} ({base / sec:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
