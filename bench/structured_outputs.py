"""Constrained and free requests in one batch: does a neighbour's grammar slow the free ones?

Each round runs the same 16 requests through our Engine twice, side by side:
- mixed: 8 free requests (ignore_eos, max_tokens M) + 8 constrained by a JSON schema (a list of
  people, as an extraction call would ask for);
- free: the same 16 requests with no constraint; each of the 8 formerly constrained ones gets
  max_tokens = the length it reached when constrained (ignore_eos), so the batch has the same
  size at every step in both runs and only the grammar work differs.
The free requests' TPOT (per request: (last token time - first token time) / (tokens - 1)) is
compared between the two runs; rounds alternate which run goes first. Every constrained output
is checked with jsonschema. Also reported: the share of step time spent filling the grammar
bitmasks (timed around the runner's sampler).

Writes bench/results/structured_outputs.json.
Run: .venv/bin/python bench/structured_outputs.py [--model default|tiny|DIR] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._models import model_dir as resolve_model  # noqa: E402
from bench.serving import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 110},
                    "city": {"type": "string", "maxLength": 16},
                },
                "required": ["name", "age", "city"],
                "additionalProperties": False,
            },
            "minItems": 2,
            "maxItems": 4,
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
PROMPTS = [
    "List a few people you know of, with their age and city.",
    "Invent the members of a small chess club.",
    "Who lives on your street? Give names, ages and cities.",
    "Describe the guests at a dinner party.",
    "Name some travellers on a night train.",
    "Who was at the meeting this morning?",
    "Make up three neighbours and where they come from.",
    "List the players of a tiny football team.",
]


def run(engine, prompts, params) -> dict[str, dict]:
    """Add every request, step to the end; per request its token times and output."""
    for rid, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(rid), ids, p)
    times: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    texts = {k: "" for k in times}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.request_id].extend([now] * len(out.new_token_ids))
            texts[out.request_id] += out.new_text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return {k: {"times": times[k], "text": texts[k], "finish": reasons.get(k)} for k in times}


def tpot(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


class GrammarTimer:
    """Wall time the runner spends filling grammar bitmasks (wraps structured.fill_bitmask)."""

    def __init__(self) -> None:
        import replica.runner as runner_module

        self.module = runner_module
        self.original = runner_module.fill_bitmask
        self.seconds = 0.0

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        runner_module.fill_bitmask = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--free-tokens", type=int, default=96)
    parser.add_argument("--out", default=str(RESULTS / "structured_outputs.json"))
    args = parser.parse_args()

    import jsonschema

    from replica.config import EngineConfig
    from replica.engine import Engine
    from replica.request import SamplingParams, StructuredOutput

    model = resolve_model(args.model)
    engine = Engine(
        EngineConfig(
            model=str(model),
            device="cpu",
            max_num_seqs=16,
            max_num_batched_tokens=512,
            max_model_len=1024,
            enable_prefix_caching=False,
        )
    )
    tok = engine.tokenizer
    chat = [
        tok.apply_chat_template(
            [{"role": "user", "content": p + " Answer as JSON."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for p in PROMPTS
    ]
    constrained_ids = [tok.encode(t, add_special_tokens=False) for t in chat]
    free_ids = [tok.encode(t, add_special_tokens=False) for t in reversed(chat)]
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    free = SamplingParams(max_tokens=args.free_tokens, temperature=0, ignore_eos=True)
    timer = GrammarTimer()
    engine.compile_grammar(SamplingParams(structured=spec))  # compiled once, before timing
    rounds = []
    for r in range(args.rounds):
        constrained = [
            SamplingParams(max_tokens=200, temperature=0.8, seed=100 * r + i, structured=spec)
            for i in range(8)
        ]
        prompts = free_ids + constrained_ids
        order = ["mixed", "free"] if r % 2 == 0 else ["free", "mixed"]
        result: dict[str, dict] = {}
        lengths = None
        if order[0] == "free":  # the constrained lengths come from a mixed run: make one first
            probe = run(engine, prompts, [free] * 8 + constrained)
            lengths = [len(probe[str(8 + i)]["times"]) for i in range(8)]
        for kind in order:
            timer.seconds = 0.0
            start = time.perf_counter()
            if kind == "mixed":
                outs = run(engine, prompts, [free] * 8 + constrained)
                lengths = [len(outs[str(8 + i)]["times"]) for i in range(8)]
            else:
                matched = [
                    SamplingParams(max_tokens=n, temperature=0.8, seed=100 * r + i, ignore_eos=True)
                    for i, n in enumerate(lengths)
                ]
                outs = run(engine, prompts, [free] * 8 + matched)
            wall = time.perf_counter() - start
            free_tpots = [tpot(outs[str(i)]["times"]) for i in range(8)]
            entry = {
                "wall_s": wall,
                "free_tpot_median_ms": 1e3 * statistics.median(free_tpots),
                "grammar_fill_s": timer.seconds,
            }
            if kind == "mixed":
                valid = 0
                for i in range(8):
                    out = outs[str(8 + i)]
                    if out["finish"] == "stop":
                        jsonschema.validate(json.loads(out["text"]), SCHEMA)
                        valid += 1
                entry["constrained_stopped_and_valid"] = valid
                entry["constrained_tokens"] = lengths
            result[kind] = entry
        result["ratio_free_tpot_mixed_over_free"] = (
            result["mixed"]["free_tpot_median_ms"] / result["free"]["free_tpot_median_ms"]
        )
        rounds.append(result)
        print(
            f"round {r}: free TPOT mixed {result['mixed']['free_tpot_median_ms']:.2f} ms, "
            f"alone {result['free']['free_tpot_median_ms']:.2f} ms, ratio "
            f"{result['ratio_free_tpot_mixed_over_free']:.3f}; constrained valid "
            f"{result['mixed']['constrained_stopped_and_valid']}/8, lengths "
            f"{result['mixed']['constrained_tokens']}; grammar fill "
            f"{result['mixed']['grammar_fill_s'] * 1e3:.1f} ms of {result['mixed']['wall_s']:.2f} s",
            flush=True,
        )
    ratios = [r["ratio_free_tpot_mixed_over_free"] for r in rounds]
    summary = {
        "model": str(model),
        "machine": machine_info(),
        "rounds": rounds,
        "median_ratio": statistics.median(ratios),
        "ratios": ratios,
        "grammar_fill_share_median": statistics.median(
            r["mixed"]["grammar_fill_s"] / r["mixed"]["wall_s"] for r in rounds
        ),
    }
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(
        f"median ratio (free requests' TPOT, mixed batch / unconstrained batch): "
        f"{summary['median_ratio']:.3f} over {len(ratios)} rounds; grammar fill share "
        f"{summary['grammar_fill_share_median']:.4f}"
    )


if __name__ == "__main__":
    main()
