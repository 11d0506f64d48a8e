"""First-token time of a lone prefill of the default model (SmolLM2-135M, Q4_1 GGUF, int8
activations) with the quantized matmuls' crossover set several ways, interleaved in one process.

The engine is built once (its start-up calibration chooses the `auto` crossover: logged, and
printed here); then each round runs, for every prompt length and every variant of
STEPSERVE_QUANT_CROSSOVER (`--variants`, e.g. 512 = the old constant for Q4_1/Q8_0), one
prefill of fresh random tokens (no prefix-cache hit) with max_tokens=1, and records the summed
wall time of its Engine.step calls. Prints the median ms per length and variant, and each
variant's ratio to the first one.

Run: .venv/bin/python bench/probes/quant_crossover.py [--threads 1] [--lengths 64,128,256,512]
        [--variants 512,auto] [--rounds 5]
Writes bench/results/quant_crossover.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

RESULTS = Path(__file__).resolve().parents[1] / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as built)")
    ap.add_argument("--lengths", default="64,128,256,512")
    ap.add_argument("--variants", default="512,auto", help="STEPSERVE_QUANT_CROSSOVER values")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gap", type=float, default=0.05, help="seconds between prefills")
    ap.add_argument("--out", default="quant_crossover")
    args = ap.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    variants = args.variants.split(",")

    import torch

    from replica.engine import LLM
    from replica.quant import crossover, kernels
    from replica.quant.formats import QType
    from replica.request import SamplingParams

    os.environ.pop(crossover.ENV, None)  # the engine's own calibration: auto
    llm = LLM(max_num_batched_tokens=max(2048, max(lengths)))
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = llm.engine
    step = engine.step
    times: list[float] = []

    def timed():
        started = time.perf_counter()
        out = step()
        times.append(1000 * (time.perf_counter() - started))
        return out

    engine.step = timed
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def use(variant: str) -> dict[str, int]:
        os.environ[crossover.ENV] = variant
        kernels.reset_crossover()  # chosen again from the variable at the next matmul
        return {t.name: kernels.crossover_m(t, "int8") for t in (QType.Q4_1, QType.Q8_0)}

    def prefill(n: int) -> float:
        times.clear()
        llm.generate([[rng.randrange(1000, 40000) for _ in range(n)]], params)
        return sum(times)

    chosen = {v: use(v) for v in variants}
    print(f"{torch.get_num_threads()} threads; crossover rows per variant: {chosen}", flush=True)
    for v in variants:  # warm-up
        use(v)
        for n in lengths:
            prefill(n)
    ms: dict[str, dict[int, list[float]]] = {v: {n: [] for n in lengths} for v in variants}
    for _ in range(args.rounds):
        for n in lengths:
            for v in variants:
                use(v)
                time.sleep(args.gap)
                ms[v][n].append(round(prefill(n), 2))
    rows = []
    for n in lengths:
        medians = {v: statistics.median(ms[v][n]) for v in variants}
        base = medians[variants[0]]
        line = f"prompt {n:>5} tokens:"
        for v in variants:
            line += f"  {v}={medians[v]:8.1f} ms ({medians[v] / base:4.2f}x)"
        print(line, flush=True)
        rows.append({"tokens": n, "median_ms": medians, "ms": {v: ms[v][n] for v in variants}})
    llm.shutdown()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    record = {"args": vars(args), "threads": torch.get_num_threads(), "crossover": chosen}
    path.write_text(json.dumps(record | {"rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
