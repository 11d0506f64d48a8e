"""Per-step work outside the forward at steady decode: for each scenario and batch size B, B
requests are prefilled (untimed), then pure-decode steps with all B running are timed through
the engine's step listener and the runner's phase clocks.

Scenarios (every request of the batch alike unless said):
  greedy        temperature 0
  seeded        temperature 0.8, a seed per request
  topk_topp     temperature 0.8, top_k 50, top_p 0.9 (unseeded)
  top_p         temperature 1.0, top_p 0.95 (what an OpenAI client commonly sends)
  logprobs5     greedy with logprobs=5
  prompt_lp     greedy with prompt_logprobs=5 (decode steps: what a finished prompt still costs)
  json          one request constrained by a JSON schema among B-1 free greedy ones
  greedy_nodraft  greedy with prompt-lookup drafts off (all others run with the default: on)

Per step (medians, ms): step, schedule, prepare (batch layout + input tensors), forward, sample
(all of the runner after the forward), of which bitmask (grammar mask fill) and prompt_lp, and
update (the rest: update_from_output, output building, detokenizing); outside = step - forward.

Run: .venv/bin/python bench/decode_step_overhead.py [--model tiny|default] [--steps 60]
     [--batch-sizes 1,8,32] [--scenarios greedy,json] [--threads 1] [--root DIR] [--out FILE]
(--root runs another checkout's engine with this script, for an A/B.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SCENARIOS = (
    "greedy",
    "seeded",
    "topk_topp",
    "top_p",
    "logprobs5",
    "prompt_lp",
    "json",
    "greedy_nodraft",
)
PROMPT_LEN = 64
JSON_SCHEMA = {"type": "array", "items": {"type": "integer"}}
PHASES = ("schedule", "prepare", "forward", "sample", "bitmask", "prompt_lp")


def _params(scenario: str, i: int, max_tokens: int):
    from replica.request import SamplingParams
    from replica.sampling_params import StructuredOutput

    if scenario == "seeded":
        return SamplingParams(
            temperature=0.8, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True
        )
    if scenario == "topk_topp":
        return SamplingParams(
            temperature=0.8, top_k=50, top_p=0.9, max_tokens=max_tokens, ignore_eos=True
        )
    if scenario == "top_p":
        return SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, ignore_eos=True)
    if scenario == "logprobs5":
        return SamplingParams(temperature=0.0, logprobs=5, max_tokens=max_tokens, ignore_eos=True)
    if scenario == "prompt_lp":
        return SamplingParams(
            temperature=0.0, prompt_logprobs=5, max_tokens=max_tokens, ignore_eos=True
        )
    if scenario == "json" and i == 0:
        spec = StructuredOutput("json", json.dumps(JSON_SCHEMA))
        return SamplingParams(temperature=0.0, structured=spec, max_tokens=max_tokens)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def measure(engine, scenario: str, batch: int, num_steps: int, warmup: int = 5) -> dict:
    """Median phase times of `num_steps` decode steps with `batch` requests running."""
    import random

    rng = random.Random(batch)
    vocab = engine.runner.vocab_size
    max_tokens = num_steps + warmup + 64
    steps: list[dict] = []
    live: dict[str, int] = {}
    serial = iter(range(1 << 30))

    def add(i: int) -> None:
        rid = f"{scenario}-{batch}-{next(serial)}"
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]
        engine.add_request(rid, prompt, _params(scenario, i, max_tokens))
        live[rid] = i

    def record(engine, so, outputs, step_time) -> None:
        times = engine.runner.step_times
        decode = len(so.scheduled) == batch and all(
            s.start >= s.request.num_prompt_tokens for s in so.scheduled
        )
        if decode:
            steps.append(
                {
                    "step": step_time,
                    "schedule": engine.last_schedule_time,
                    "prepare": times.prepare,
                    "forward": times.forward,
                    "sample": times.sample,
                    "bitmask": getattr(times, "bitmask", 0.0),
                    "prompt_lp": getattr(times, "prompt_logprobs", 0.0),
                    "tokens": so.total_num_scheduled_tokens,
                }
            )

    for i in range(batch):
        add(i)
    engine.step_listeners.append(record)
    try:
        while len(steps) < num_steps + warmup:
            for out in engine.step():
                if out.finished and out.request_id in live:  # a closed grammar: a fresh one
                    add(live.pop(out.request_id))
    finally:
        engine.step_listeners.remove(record)
        engine.abort(list(live))
        while engine.has_unfinished():
            engine.step()
    steps = steps[warmup:]
    out = {"steps": len(steps)}
    for name in ("step", *PHASES):
        out[name] = round(statistics.median(s[name] for s in steps) * 1e3, 3)
    out["update"] = round(
        statistics.median(s["step"] - sum(s[p] for p in PHASES[:4]) for s in steps) * 1e3, 3
    )
    out["outside"] = round(statistics.median(s["step"] - s["forward"] for s in steps) * 1e3, 3)
    out["tokens"] = statistics.median(s["tokens"] for s in steps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, default, default-gguf or a dir")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    parser.add_argument("--root", default=None, help="the checkout whose engine runs")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    root = Path(args.root).resolve() if args.root else Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from replica.engine import LLM
    from replica.tiny_models import resolve_model_dir

    model = resolve_model_dir(args.model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    scenarios = args.scenarios.split(",")
    results: dict = {"model": args.model, "root": str(root), "threads": torch.get_num_threads()}
    llms: dict[bool, LLM] = {}
    print(f"{'scenario':15} {'B':>3} " + " ".join(f"{h:>9}" for h in (
        "step", "forward", "outside", "schedule", "prepare", "sample", "bitmask", "prompt_lp",
        "update")))  # fmt: skip
    for scenario in scenarios:
        drafts = scenario != "greedy_nodraft"
        if drafts not in llms:
            fields = {} if drafts else {"num_speculative_tokens": 0}
            llms[drafts] = LLM(model, dtype=args.dtype, max_num_seqs=max(batches), **fields)
        engine = llms[drafts].engine
        for batch in batches:
            started = time.perf_counter()
            row = measure(engine, scenario, batch, args.steps)
            row["wall_s"] = round(time.perf_counter() - started, 1)
            results.setdefault(scenario, {})[batch] = row
            print(f"{scenario:15} {batch:>3} " + " ".join(f"{row[h]:>9.3f}" for h in (
                "step", "forward", "outside", "schedule", "prepare", "sample", "bitmask",
                "prompt_lp", "update")), flush=True)  # fmt: skip
    for llm in llms.values():
        llm.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
