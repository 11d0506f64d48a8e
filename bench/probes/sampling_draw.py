"""The cost of a sampled (temperature > 0) step's draw, side by side in one run: the sampler's
inverse-transform draw (one uniform per row against the cumulative probabilities) against the
exponential race it replaced (argmax p / E with E ~ Exp(1): V draws per row, from the row's own
generator when the request is seeded). Whole `Sampler` calls at the default model's vocabulary
(49152) and batch sizes 1-64, all rows seeded or none; medians of `--reps` calls. Then the
offline engine end to end: W1's first 64 prompts, temperature 0.8, seeded, 64 tokens each, with
each draw in turn (`--engine-repeats` alternations).

Run: .venv/bin/python bench/probes/sampling_draw.py [--reps 30] [--out bench/results/sampling_draw.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from replica.layers import sampler as sampler_module  # noqa: E402
from replica.request import SamplingParams  # noqa: E402


def exponential_race(self, logits, params, greedy, generators, default_generator):
    """The previous draw (replica/layers/sampler.py before the inverse transform), kept here
    as the baseline."""
    probs = torch.softmax(sampler_module.sampling_logits(logits, params), dim=-1)
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        if len(unseeded) == len(generators):
            noise.exponential_(generator=default_generator)
        else:
            rows = torch.tensor(unseeded)
            draw = torch.empty(len(unseeded), probs.shape[1])
            noise.index_copy_(0, rows, draw.exponential_(generator=default_generator))
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def time_calls(sampler, batch: int, seeded: bool, reps: int, vocab: int) -> float:
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch))
    params = [SamplingParams(temperature=0.8, seed=i if seeded else None) for i in range(batch)]
    generators = [torch.Generator().manual_seed(i) if seeded else None for i in range(batch)]
    default = torch.Generator().manual_seed(0)
    times = []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        sampler(logits, params, generators, default)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


def engine_runs(num_requests: int, max_tokens: int, repeats: int) -> dict:
    """W1's prompts (bench/offline_throughput.py, the first `num_requests`), temperature 0.8,
    seeded per request, `max_tokens` each, through the offline engine with each draw in turn."""
    from bench.offline_throughput import make_workload
    from replica.engine import LLM

    llm = LLM(None, max_num_seqs=max(64, num_requests))
    prompts = make_workload(num_requests, llm.engine.vocab_size)["prompts"]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(num_requests)
    ]
    runner_sampler = llm.engine.runner.sampler
    baseline = exponential_race.__get__(runner_sampler)
    current = runner_sampler._sample
    walls: dict[str, list[float]] = {"exponential_race": [], "inverse_transform": []}
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    for _ in range(repeats):
        for name, draw in (("exponential_race", baseline), ("inverse_transform", current)):
            runner_sampler._sample = draw
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            walls[name].append(time.perf_counter() - t0)
            assert sum(len(o.output_token_ids) for o in outs) == num_requests * max_tokens
    llm.shutdown()
    medians = {k: round(statistics.median(v), 2) for k, v in walls.items()}
    return {
        "num_requests": num_requests,
        "max_tokens": max_tokens,
        "wall_s": walls,
        "median_wall_s": medians,
        "speedup": round(medians["exponential_race"] / medians["inverse_transform"], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--engine-requests", type=int, default=64, help="0: skip the engine runs")
    p.add_argument("--engine-tokens", type=int, default=64)
    p.add_argument("--engine-repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    new = sampler_module.Sampler()
    old = sampler_module.Sampler()
    old._sample = exponential_race.__get__(old)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for seeded in (False, True):
            # alternate the two, so a busy host slows both alike
            t_old, t_new = [], []
            for _ in range(3):
                t_old.append(time_calls(old, batch, seeded, args.reps, args.vocab))
                t_new.append(time_calls(new, batch, seeded, args.reps, args.vocab))
            row = {
                "batch": batch,
                "seeded": seeded,
                "exponential_race_ms": round(statistics.median(t_old), 3),
                "inverse_transform_ms": round(statistics.median(t_new), 3),
            }
            row["speedup"] = round(row["exponential_race_ms"] / row["inverse_transform_ms"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    engine = None
    if args.engine_requests:
        engine = engine_runs(args.engine_requests, args.engine_tokens, args.engine_repeats)
        print(json.dumps(engine), flush=True)
    if args.out:
        result = {"vocab": args.vocab, "threads": torch.get_num_threads(), "rows": rows,
                  "engine": engine}  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
