"""LoRA serving cost: output tokens/s of one offline batch (N requests, fixed prompt and output
lengths, greedy, ignore_eos) on the base model alone (LoRA off, and LoRA on with no adapter in
the batch), then spread round-robin over 1, 4 and 16 adapters (all linear layers targeted),
each as a ratio to the base model; and the time to load an adapter (read, check, install:
Engine.add_lora's load_s, median over loads) per rank. Adapters are random PEFT adapters made
with peft for the model (replica/tiny_lora.py). Writes bench/results/lora.json (--quick writes
nothing unless --out is given).

Run: .venv/bin/python bench/lora.py [--model tiny|default|DIR] [--num-requests 64]
     [--output-len 128] [--adapters 1,4,16] [--rank 16] [--load-ranks 8,16,64] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from _models import ROOT, model_dir

RESULTS = ROOT / "bench" / "results"


def make_adapters(model: Path, root: Path, count: int, rank: int, targets) -> list:
    from replica.request import LoRARequest
    from replica.tiny_lora import build_tiny_adapter

    out = []
    for i in range(count):
        path = root / f"r{rank}-{i}"
        if not (path / "adapter_config.json").exists():
            build_tiny_adapter(model, path, rank=rank, target_modules=targets, seed=i, scale=0.02)
        out.append(LoRARequest(f"r{rank}-{i}", str(path)))
    return out


def throughput(llm, prompts, output_len: int, loras, repeats: int) -> dict:
    """The batch timed `repeats` times, every prompt with its adapter (None: the base model):
    the median run's tokens/s, and every run's."""
    from replica.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), lora=loras[0])  # warm-up
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora=loras)
        elapsed = time.perf_counter() - start
        runs.append(sum(len(o.output_token_ids) for o in outs) / elapsed)
    tokens = sum(len(o.output_token_ids) for o in outs)
    median = statistics.median(runs)
    return {"output_tokens": tokens, "seconds": round(tokens / median, 4), "tok_s": median,
            "runs_tok_s": [round(r, 1) for r in runs]}  # fmt: skip


def load_times(llm, adapters, repeats: int) -> dict:
    """Median and range of load_s (read + check + install) over `repeats` loads of each."""
    times = []
    for _ in range(repeats):
        for lora in adapters:
            llm.remove_lora(lora.name)
            times.append(llm.add_lora(lora.name, lora.path)["load_s"])
    return {
        "loads": len(times),
        "median_ms": round(statistics.median(times) * 1e3, 3),
        "min_ms": round(min(times) * 1e3, 3),
        "max_ms": round(max(times) * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, default or a model directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--adapters", default="1,4,16", help="adapter counts to spread over")
    parser.add_argument("--rank", type=int, default=16, help="rank of the throughput adapters")
    parser.add_argument("--targets", default="all", choices=["all", "attention"])
    parser.add_argument("--load-ranks", default="8,16,64")
    parser.add_argument("--load-repeats", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--adapter-dir", default=None, help="where adapters are made/reused")
    parser.add_argument("--quick", action="store_true", help="8 requests x 16 tokens")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results)")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.output_len, args.load_repeats, args.repeats = 8, 16, 2, 1

    import numpy as np
    import torch

    from replica.engine import LLM
    from replica.tiny_lora import ALL_LINEAR_MODULES, ATTENTION_MODULES

    if args.threads:
        torch.set_num_threads(args.threads)
    model = model_dir(args.model)
    targets = ALL_LINEAR_MODULES if args.targets == "all" else ATTENTION_MODULES
    counts = [int(c) for c in args.adapters.split(",")]
    load_ranks = [int(r) for r in args.load_ranks.split(",") if r]
    adapter_root = Path(args.adapter_dir or tempfile.mkdtemp(prefix="stepserve-lora-bench-"))
    adapters = make_adapters(model, adapter_root, max(counts), args.rank, targets)
    fields = {
        "dtype": args.dtype,
        "max_num_seqs": max(64, args.num_requests),
        "kv_cache_bytes": 2 << 30,
    }
    rng = np.random.default_rng(0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.num_requests)]
    base = [None] * len(prompts)
    runs = {}
    with LLM(model, **fields) as llm:
        runs["base (LoRA off)"] = throughput(llm, prompts, args.output_len, base, args.repeats)
    max_rank = max([args.rank, *load_ranks])
    lora_fields = fields | {
        "enable_lora": True,
        "max_loras": max(counts),
        "max_cpu_loras": max(counts),
        "max_lora_rank": max_rank,
    }
    with LLM(model, **lora_fields) as llm:
        runs["base (LoRA on)"] = throughput(llm, prompts, args.output_len, base, args.repeats)
        for lora in adapters:  # loaded before timing: the loads are timed separately
            llm.add_lora(lora.name, lora.path)
        for count in counts:
            loras = [adapters[i % count] for i in range(len(prompts))]
            runs[f"{count} adapter{'s' * (count > 1)}"] = throughput(
                llm, prompts, args.output_len, loras, args.repeats
            )
    base_tok_s = runs["base (LoRA off)"]["tok_s"]
    for run in runs.values():
        run["vs_base"] = round(run["tok_s"] / base_tok_s, 3)
        run["tok_s"] = round(run["tok_s"], 1)
    loads = {}
    with LLM(model, **lora_fields | {"max_cpu_loras": max(counts, default=1)}) as llm:
        for rank in load_ranks:
            rank_adapters = make_adapters(model, adapter_root, 1, rank, targets)
            loads[rank] = load_times(llm, rank_adapters, args.load_repeats)

    print(
        f"\n{model.name}, {args.dtype}, {args.num_requests} requests x {args.prompt_len} prompt "
        f"+ {args.output_len} output tokens, rank {args.rank} adapters on {args.targets} linears, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'batch':<18}{'tok/s':>10}{'vs base':>10}{'seconds':>10}")
    for name, run in runs.items():
        print(f"{name:<18}{run['tok_s']:>10.1f}{run['vs_base']:>10.3f}{run['seconds']:>10.2f}")
    print(f"\n{'rank':<8}{'load median ms':>16}{'min':>10}{'max':>10}{'loads':>8}")
    for rank, load in loads.items():
        print(
            f"{rank:<8}{load['median_ms']:>16.2f}{load['min_ms']:>10.2f}{load['max_ms']:>10.2f}"
            f"{load['loads']:>8}"
        )
    result = {
        "model": str(model),
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "rank": args.rank,
        "targets": list(targets),
        "threads": torch.get_num_threads(),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "loadavg": os.getloadavg(),
        "throughput": runs,
        "load_times": loads,
    }
    out = args.out or (None if args.quick else RESULTS / "lora.json")
    if out is not None:
        Path(out).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
