"""Batch occupancy, static vs continuous batching, on one workload (all requests queued at t=0,
long-tailed output lengths, `ignore_eos`):

- static (HF transformers `generate`): fixed batches of B in arrival order, each batch runs to
  its longest request; a finished request's row is still computed (padding) until the batch
  ends. Step times come from a stopping-criteria callback; occupancy from the known output
  lengths.
- static (our engine): the same policy on our engine (the next batch is admitted only when the
  whole batch has finished), so step costs match the continuous run exactly.
- continuous (our engine): max_num_seqs = B; a finished request's seat is refilled on the next
  step. Read from Engine.step_listeners.

Per step: tokens computed, batch slots used and slots wasted (B minus sequences in the batch).
Writes bench/results/batching.json and batch_occupancy.png.

Run: .venv/bin/python bench/batching.py [--quick] [--model tiny|default|DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._models import model_dir as resolve_model  # noqa: E402
from bench.serving import long_tail_dataset, machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def engine_timeline(model: Path, specs, batch: int, static: bool) -> dict:
    """Run `specs` through our Engine; per step: time, tokens, sequences scheduled."""
    from replica.config import EngineConfig
    from replica.engine import Engine
    from replica.request import SamplingParams

    max_len = max(len(s.prompt_ids) + s.output_len for s in specs)
    engine = Engine(
        EngineConfig(
            model=str(model),
            device="cpu",
            max_num_seqs=batch,
            max_num_batched_tokens=max(512, batch * 64),
            num_kv_blocks=batch * math.ceil(max_len / 16) + 8,  # never the bottleneck here
            enable_prefix_caching=False,
        )
    )
    steps: list[dict] = []
    t_zero = time.perf_counter()

    def listener(_engine, scheduler_output, _outputs, step_time) -> None:
        steps.append(
            {
                "t": time.perf_counter() - t_zero,
                "dt": step_time,
                "tokens": scheduler_output.total_num_scheduled_tokens,
                "seqs": len(scheduler_output.scheduled),
            }
        )

    engine.step_listeners.append(listener)

    def add(i: int) -> None:
        s = specs[i]
        params = SamplingParams(max_tokens=s.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), s.prompt_ids, params)

    # one untimed warm-up request (first-call allocations)
    engine.add_request("warm", specs[0].prompt_ids, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    steps.clear()
    t_zero = time.perf_counter()
    if static:
        for start in range(0, len(specs), batch):
            for i in range(start, min(start + batch, len(specs))):
                add(i)
            while engine.has_unfinished():
                engine.step()
    else:
        for i in range(len(specs)):
            add(i)
        while engine.has_unfinished():
            engine.step()
    wall = time.perf_counter() - t_zero
    engine.shutdown()
    return finish_timeline(steps, batch, wall, specs)


def hf_static_timeline(model: Path, specs, batch: int) -> dict:
    """HF `generate` in fixed batches (left-padded, greedy, exactly max(output_len) new tokens
    per batch). Occupancy per step from the output lengths: a request is useful until its own
    length; the slot computes padding for the rest of the batch."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    step_times: list[float] = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            step_times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def run_batch(group) -> None:
        width = max(len(s.prompt_ids) for s in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, s in enumerate(group):
            ids[row, width - len(s.prompt_ids) :] = torch.tensor(s.prompt_ids)
            mask[row, width - len(s.prompt_ids) :] = 1
        n_new = max(s.output_len for s in group)
        with torch.no_grad():
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([Stamp()]),
            )

    run_batch(specs[:1])  # warm-up
    steps: list[dict] = []
    t_zero = time.perf_counter()
    for start in range(0, len(specs), batch):
        group = specs[start : start + batch]
        step_times.clear()
        t_batch = time.perf_counter()
        run_batch(group)
        prev = t_batch
        width = max(len(s.prompt_ids) for s in group)
        for k, stamp in enumerate(step_times):
            steps.append(
                {
                    "t": stamp - t_zero,
                    "dt": stamp - prev,
                    # every row is computed, finished or not (and the prompt with its padding)
                    "tokens": len(group) * width if k == 0 else len(group),
                    "seqs": sum(1 for s in group if s.output_len > k),
                }
            )
            prev = stamp
    wall = time.perf_counter() - t_zero
    return finish_timeline(steps, batch, wall, specs)


def finish_timeline(steps: list[dict], batch: int, wall: float, specs) -> dict:
    for s in steps:
        s["wasted_slots"] = batch - s["seqs"]
    used = sum(s["seqs"] for s in steps)
    out_tokens = sum(s.output_len for s in specs)
    return {
        "wall_s": round(wall, 3),
        "num_steps": len(steps),
        "slot_utilization": round(used / (batch * len(steps)), 4) if steps else None,
        "wasted_slot_steps": sum(s["wasted_slots"] for s in steps),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / wall, 1),
        "steps": [
            {k: (round(v, 5) if isinstance(v, float) else v) for k, v in s.items()} for s in steps
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, default, or a local HF model dir")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--batch", type=int, default=8, help="B: static batch size = max_num_seqs")
    p.add_argument("--input-len", type=int, default=48)
    p.add_argument("--output-median", type=int, default=24)
    p.add_argument("--output-max", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--quick", action="store_true", help="16 requests, no files written")
    args = p.parse_args()
    if args.quick:
        args.num_requests = 16
    import torch

    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    specs = long_tail_dataset(
        args.num_requests,
        args.input_len,
        args.output_median,
        args.output_max,
        1.0,
        random.Random(args.seed),
    )
    runs = {
        "continuous (stepserve engine)": engine_timeline(model, specs, args.batch, static=False),
        "static (stepserve engine)": engine_timeline(model, specs, args.batch, static=True),
        "static (HF generate)": hf_static_timeline(model, specs, args.batch),
    }
    print(
        f"{args.num_requests} requests, batch {args.batch}, output lengths "
        f"{sorted(s.output_len for s in specs)}"
    )
    print(f"{'system':<32} {'wall s':>8} {'steps':>6} {'slot util':>10} {'wasted':>7} {'tok/s':>8}")
    for name, r in runs.items():
        print(
            f"{name:<32} {r['wall_s']:>8.2f} {r['num_steps']:>6} {r['slot_utilization']:>10.1%} "
            f"{r['wasted_slot_steps']:>7} {r['output_tokens_per_s']:>8.1f}"
        )
    cont, stat = runs["continuous (stepserve engine)"], runs["static (stepserve engine)"]
    speedup = stat["wall_s"] / cont["wall_s"]
    print(
        f"continuous vs static on the same engine: {speedup:.2f}x faster, "
        f"{stat['num_steps'] / cont['num_steps']:.2f}x fewer steps"
    )
    if args.quick:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "benchmark": "batching",
        "model": args.model,
        "batch": args.batch,
        "num_requests": args.num_requests,
        "output_lens": [s.output_len for s in specs],
        "prompt_lens": [len(s.prompt_ids) for s in specs],
        "torch_threads": args.threads,
        "host": machine_info(),
        "continuous_vs_static_engine_speedup": round(speedup, 3),
        "runs": runs,
    }
    path = RESULTS / "batching.json"
    path.write_text(json.dumps(out) + "\n")
    from bench.plots import plot_batch_occupancy

    png = plot_batch_occupancy(out, RESULTS / "batch_occupancy.png")
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
