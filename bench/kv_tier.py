"""KV tiers and KV transfer (docs/kv-transfer.md), in-process engines (no Ray):

1. the tier's hit rate: a pool smaller than the working set (W prompts of P tokens cycled R
   times), with the host tier off and on: prefix-cache hit rate, tokens recomputed, wall time;
2. a migration's resume: a request cut after some output tokens continues on a fresh replica
   (request.Resume): its prompt + output recomputed there, or its prefix imported from the
   source first (export + import, in-process copies: Ray's hop is not included): wall seconds
   to the first new token, both ways.

Writes bench/results/kv_tier.json. Run on a quiet host:
  .venv/bin/python bench/kv_tier.py --model default        # SmolLM2-135M fp32
  .venv/bin/python bench/kv_tier.py --model tiny --quick   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._models import model_dir  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine import Engine  # noqa: E402
from replica.kv_transfer import prompt_block_hashes  # noqa: E402
from replica.request import EngineRequest, Resume, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "kv_tier.json"
BLOCK = 16


def engine(path, **fields) -> Engine:
    fields = {"device": "cpu", "dtype": "float32", "block_size": BLOCK, **fields}
    return Engine(EngineConfig(model=str(path), **fields))


def drain(e: Engine) -> list[int]:
    tokens = []
    while e.has_unfinished():
        for out in e.step():
            tokens += out.new_token_ids
    return tokens


def vocab_of(path) -> int:
    from replica.loader import load_hf_config

    return int(load_hf_config(path).vocab_size)


def tier_hit_rate(path, working_set: int, prompt_len: int, rounds: int, pool_blocks: int) -> dict:
    vocab = vocab_of(path)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(working_set)]
    out = {}
    for label, offload in (("tier_off", 0), ("tier_on", 1 << 30)):
        e = engine(path, num_kv_blocks=pool_blocks, kv_offload_bytes=offload, kv_transfer=False,
                   max_model_len=prompt_len + 16)  # fmt: skip
        started = time.perf_counter()
        for r in range(rounds):
            for i, p in enumerate(prompts):
                e.add_request(f"{r}-{i}", p, SamplingParams(temperature=0.0, max_tokens=1))
                drain(e)
        s = e.stats()
        out[label] = {
            "wall_s": round(time.perf_counter() - started, 3),
            "prefix_hit_rate": round(s.prefix_cache_hits / max(s.prefix_cache_queries, 1), 3),
            "tier_hit_tokens": s.kv_tier_hit_tokens,
            "tier_saves": s.kv_tier_saves,
            "tier_blocks": s.kv_tier_blocks,
        }
        e.shutdown()
    return out


def resume_time(path, prompt_len: int, cut_after: int) -> dict:
    vocab = vocab_of(path)
    rng = random.Random(1)
    prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=cut_after + 8)
    source = engine(path, max_model_len=prompt_len + 64)
    source.add(EngineRequest(prompt, params, "orig"))
    produced = []
    while len(produced) < cut_after:
        for out in source.step():
            produced += out.new_token_ids
    produced = produced[:cut_after]
    results = {}
    for label in ("recompute", "transfer"):
        target = engine(path, max_model_len=prompt_len + 64)
        # warm: a first forward of a fresh engine pays one-off costs neither way should
        target.add(EngineRequest([11] * 20, SamplingParams(max_tokens=2), f"warm-{label}"))
        drain(target)
        started = time.perf_counter()
        request = EngineRequest(prompt, params, label, resume=Resume(produced, ""))
        if label == "transfer":
            # the tokens the source has blocks for: prompt + output so far
            tokens = prompt + produced
            hashes = prompt_block_hashes(tokens, BLOCK, None, len(tokens) // BLOCK)
            target.import_kv(source.export_kv(hashes), hashes)
        target.add(request)
        first = None
        while first is None:
            for out in target.step():
                if out.new_token_ids:
                    first = time.perf_counter() - started
        results[label] = {"first_token_s": round(first, 4),
                          "tier_hit_tokens": target.stats().kv_tier_hit_tokens}  # fmt: skip
        target.shutdown()
    source.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    path = model_dir(args.model)
    quick = args.quick
    report = {
        "model": args.model,
        "tier": tier_hit_rate(
            path, 4 if quick else 16, 128 if quick else 512, 2, 24 if quick else 96
        ),  # fmt: skip
        "resume": resume_time(path, 128 if quick else 1024, 8 if quick else 32),
    }
    print(json.dumps(report, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
