"""What first-touch page faults in the CPU KV cache cost a step, with and without the prefault
thread (`cpu_kv_prefault_mib`, replica/kv_prefault.py).

Each variant runs in a process of its own (the default model, fp32, this host's threads, drafts
off), built fresh, so its KV cache is fresh memory as a new replica's is. After `--settle`
seconds idle (the thread maps its first window then), it runs `--requests` prompts of
`--prompt-len` random token ids one at a time with 1 output token (a prefill each, new blocks
each: no prefix hits), then, after `--settle` seconds more, one `--decode-tokens` greedy decode.
For each it records the wall time and the process's minor page faults (getrusage: the prefault
thread's own count too, so "on" counts the pages it mapped meanwhile), so the faults a step
takes are read directly. Variants alternate for `--rounds`; medians per variant.

Run: .venv/bin/python bench/probes/kv_prefault.py --rounds 3 --out kv_prefault     # ~2 min
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parents[1] / "results"
VARIANTS = {"off": 0, "on": 128}  # cpu_kv_prefault_mib


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(args) -> dict:
    sys.path.insert(0, str(ROOT))
    from replica.default_model import default_model_dir
    from replica.engine import LLM
    from replica.request import SamplingParams

    model = args.model or str(default_model_dir())
    llm = LLM(model, dtype="float32", num_speculative_tokens=0, cpu_kv_prefault_mib=args.mib)
    time.sleep(args.settle)
    rng = random.Random(args.seed)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    prefill_ms, prefill_faults = [], []
    for _ in range(args.requests):
        ids = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
        f0, t0 = faults(), time.perf_counter()
        llm.generate([ids], one)
        prefill_ms.append((time.perf_counter() - t0) * 1e3)
        prefill_faults.append(faults() - f0)
    time.sleep(args.settle)  # the thread catches up on the prefills' blocks before the decode
    ids = [rng.randrange(100, 40000) for _ in range(20)]
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    f0, t0 = faults(), time.perf_counter()
    llm.generate([ids], params)
    decode_ms = (time.perf_counter() - t0) * 1e3 / args.decode_tokens
    decode_faults = (faults() - f0) / args.decode_tokens
    prefaulter = getattr(llm.engine.runner, "kv_prefault", None)
    out = {
        "prefill_ms": prefill_ms,
        "prefill_faults": prefill_faults,
        "decode_ms_per_token": decode_ms,
        "decode_faults_per_token": decode_faults,
        "prefaulted_blocks": getattr(prefaulter, "populated_blocks", None),
    }
    llm.shutdown()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=75)
    p.add_argument("--decode-tokens", type=int, default=100)
    p.add_argument("--settle", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--out", default=None, help="results name under bench/results/")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mib", type=int, default=128, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            cmd = [sys.executable, __file__, "--child", "--mib", str(VARIANTS[name])]
            for flag in ("requests", "prompt_len", "decode_tokens", "settle", "seed"):
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            if args.model:
                cmd += ["--model", args.model]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append(run)
            print(
                f"round {r + 1} {name:>3}: prefill p50 {statistics.median(run['prefill_ms']):.1f}"
                f" ms, faults p50 {statistics.median(run['prefill_faults']):.0f}; decode "
                f"{run['decode_ms_per_token']:.2f} ms/token, "
                f"{run['decode_faults_per_token']:.1f} faults/token",
                flush=True,
            )
    summary = {
        name: {
            "prefill_ms_p50": statistics.median(x for run in rs for x in run["prefill_ms"]),
            "prefill_faults_p50": statistics.median(x for run in rs for x in run["prefill_faults"]),
            "decode_ms_per_token_p50": statistics.median(run["decode_ms_per_token"] for run in rs),
            "decode_faults_per_token_p50": statistics.median(
                run["decode_faults_per_token"] for run in rs
            ),
        }
        for name, rs in runs.items()
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        RESULTS.mkdir(exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k not in ("child", "mib", "out")}
        (RESULTS / f"{args.out}.json").write_text(
            json.dumps({"settings": settings, "summary": summary, "runs": runs}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
