"""Fixed-batch decode step time, ours or vLLM's CPU build, on the default model in fp32.

For each batch size B: B random 128-token prompts; time generating 1 token (prefill) and 65
tokens, and report (t65 - t1) / 64 ms per decode step, the median of --reps runs. Prefix caching
is off in both so every run prefills alike.

    .venv/bin/python bench/probes/decode_steps.py ours 1,4,8,16,32
    VLLM_CPU_OMP_THREADS_BIND=0-1 /work/vllm-venv/bin/python bench/probes/decode_steps.py vllm 1,4,8,16,32
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

MODEL = Path.home() / ".cache" / "stepserve" / "SmolLM2-135M-Instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("system", choices=["ours", "vllm"])
    parser.add_argument("batches", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="ours: torch threads")
    parser.add_argument("--model", default=str(MODEL))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    prompts = [[rng.randrange(49152) for _ in range(128)] for _ in range(max(batches))]

    if args.system == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(
            model=args.model, dtype="float32", max_model_len=2048, enable_prefix_caching=False
        )

        def generate(batch, n):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            inputs = [TokensPrompt(prompt_token_ids=p) for p in batch]
            llm.generate(inputs, params, use_tqdm=False)
    else:
        import torch

        torch.set_num_threads(args.threads)
        from replica import LLM, SamplingParams

        llm = LLM(
            model=args.model,
            dtype="float32",
            kv_cache_bytes=2 << 30,
            max_num_seqs=max(batches),
            max_num_batched_tokens=8192,
            enable_prefix_caching=False,
            num_speculative_tokens=0,  # one token per request per step, as vLLM's here
        )

        def generate(batch, n):
            llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))

    generate(prompts[:2], 8)  # warm-up
    for b in batches:
        runs = []
        for _ in range(args.reps):
            start = time.perf_counter()
            generate(prompts[:b], 1)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            generate(prompts[:b], args.steps + 1)
            runs.append((time.perf_counter() - start - prefill) / args.steps * 1000)
        print(
            f"{args.system} batch={b}: {statistics.median(runs):.1f} ms/step "
            f"(runs {', '.join(f'{r:.1f}' for r in runs)})",
            flush=True,
        )


if __name__ == "__main__":
    main()
