"""Lone-prompt prefill, ours against vLLM, paired prompt by prompt: both engines stay loaded in
their own processes on the same cores, and each prompt is run by one then the other (the order
alternating), `--gap` seconds apart, one output token each. A prompt's two times are then taken
a second apart on the same host, so the ratio of each pair holds through the host's drift that
moves whole runs 10-50% on a shared VM (docs/perf-engine.md, "Paired"), which separate
processes run in turn (bench/offline_throughput.py --one-at-a-time) cannot tell from a change.

Reports the median of the per-prompt time ratios (ours / vLLM) overall and per prompt-length
band, each with a bootstrap 95% interval of that median, and whether the first tokens agree.
`--tree NAME=PATH` adds our engine from another checkout (e.g. the code before a change) as a
third system in the same rotation, reported against vLLM and against the tree. Writes
bench/results/<out>.json.

Run: .venv/bin/python bench/prefill_paired.py [--num-prompts 64] [--prompt-len 32,512]
     [--tree before=/tmp/before] [--vllm-python /work/vllm-venv/bin/python] [--out NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Only the standard library at module level: the vLLM worker runs this file with the Python of
# vLLM's own virtual environment.
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
KV_CACHE_GIB = 1
MARK = "@@paired "  # a worker's reply lines; anything else on its stdout is the engine's logging
BANDS = ((1, 63), (64, 127), (128, 255), (256, 511), (512, 1 << 20))


# -- workers: load, warm up, then time one prompt per line of stdin --------------------------
def worker_ours(args):
    sys.path.insert(0, args.root or str(ROOT))
    import torch

    from replica.engine import LLM
    from replica.layers.cpu_kernels import set_thread_cpus
    from replica.request import SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model_dir, dtype="float32", max_num_seqs=8, kv_cache_bytes=KV_CACHE_GIB << 30)
    cpus = sorted(os.sched_getaffinity(0))
    if torch.get_num_threads() == len(cpus):  # as the served engine core pins them
        set_thread_cpus(cpus, len(cpus), pin=True)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    return lambda prompt: llm.generate([prompt], params)[0].output_token_ids[0]


def worker_vllm(args):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model_dir, dtype="float32", max_model_len=2048, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(prompt):
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return out[0].outputs[0].token_ids[0]

    return run


def serve_worker(args) -> None:
    run = {"ours": worker_ours, "vllm": worker_vllm}[args.worker](args)
    rng = random.Random(1)
    for n in (48, 32, 200):  # warm-up: code paths and caches, untimed
        run([rng.randrange(100, 20000) for _ in range(n)])
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        prompt = json.loads(line)
        start = time.perf_counter()
        token = run(prompt)
        elapsed = time.perf_counter() - start
        print(MARK + json.dumps({"ms": round(elapsed * 1e3, 3), "token": int(token)}), flush=True)


# -- driver ----------------------------------------------------------------------------------
class Worker:
    def __init__(
        self, name: str, python: str, args, log: Path, env: dict, root: str | None = None
    ) -> None:
        kind = "vllm" if name == "vllm" else "ours"
        cmd = [python, str(Path(__file__).resolve()), "--worker", kind]
        cmd += ["--model-dir", str(args.model_dir), "--threads", str(args.threads)]
        cmd += ["--root", root] if root else []
        self.name, self.log = name, log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            cwd=str(ROOT), env=env,
        )  # fmt: skip
        self.read(timeout_hint="loading")

    def read(self, timeout_hint: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
            self._log.write(line)
        self._log.flush()
        tail = self.log.read_text()[-2000:]
        raise SystemExit(f"{self.name} worker exited while {timeout_hint}:\n{tail}")

    def time(self, prompt: list[int]) -> dict:
        self.proc.stdin.write(json.dumps(prompt) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout_hint="running a prompt")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def median_interval(values: list[float], rounds: int = 2000, seed: int = 0) -> list[float]:
    """A bootstrap 95% interval of the median."""
    rng = random.Random(seed)
    meds = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds)
    )  # fmt: skip
    return [round(meds[int(0.025 * rounds)], 3), round(meds[int(0.975 * rounds) - 1], 3)]


def summarize(lengths: list[int], ours: list[float], vllm: list[float]) -> dict:
    """Per-prompt time ratios ours / vllm (any two systems), overall and by length band."""

    def part(idx: list[int]) -> dict:
        ratios = [ours[i] / vllm[i] for i in idx]
        return {
            "prompts": len(idx),
            "median_ratio": round(statistics.median(ratios), 3),
            "median_ratio_95": median_interval(ratios),
            "first_median_ms": round(statistics.median(ours[i] for i in idx), 2),
            "second_median_ms": round(statistics.median(vllm[i] for i in idx), 2),
        }

    out = {"all": part(list(range(len(lengths))))}
    for lo, hi in BANDS:
        idx = [i for i, n in enumerate(lengths) if lo <= n <= hi]
        if idx:
            out[f"{lo}-{min(hi, max(lengths))}"] = part(idx)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", default="32,512", help="MIN,MAX: uniform lengths")
    parser.add_argument("--gap", type=float, default=0.3, help="seconds before each run")
    parser.add_argument("--model", default="default", help="default, tiny or a model directory")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument(
        "--tree", action="append", default=[], help="NAME=PATH: our engine from another checkout"
    )
    parser.add_argument("--out", default=None, help="bench/results/<out>.json")
    parser.add_argument("--worker", choices=("ours", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve_worker(args)
        return

    sys.path.insert(0, str(ROOT))
    from bench._models import model_dir
    from replica.layers import cpu_isa
    from replica.loader import load_hf_config

    if not Path(args.vllm_python).exists():
        raise SystemExit(f"no vLLM Python at {args.vllm_python} (see bench/README.md)")
    args.model_dir = model_dir(args.model)
    vocab = int(load_hf_config(args.model_dir).vocab_size)
    lo, hi = (int(n) for n in args.prompt_len.split(","))
    rng = random.Random(0)
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(args.num_prompts)
    ]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    logs = ROOT / "bench" / "_tmp"  # the workers' logs (git-ignored)
    logs.mkdir(parents=True, exist_ok=True)
    systems = [("ours", sys.executable, None)]
    for spec in args.tree:
        name, _, path = spec.partition("=")
        if not name or not Path(path, "replica").is_dir():
            raise SystemExit(f"--tree {spec!r}: expected NAME=PATH of a stepserve checkout")
        systems.append((f"ours@{name}", sys.executable, str(Path(path).resolve())))
    systems.append(("vllm", args.vllm_python, None))
    workers = {}
    times = {name: [] for name, _, _ in systems}
    tokens = {name: [] for name, _, _ in systems}
    try:
        for name, python, root in systems:
            print(f"[{time.strftime('%H:%M:%S')}] loading {name} ...", flush=True)
            log = logs / f"prefill_paired_{name.replace('@', '_')}.log"
            workers[name] = Worker(name, python, args, log, env, root)
        load = [os.getloadavg()[0]]
        for i, prompt in enumerate(prompts):
            shift = i % len(systems)  # each system first in turn
            for name, _, _ in systems[shift:] + systems[:shift]:
                time.sleep(args.gap)
                reply = workers[name].time(prompt)
                times[name].append(reply["ms"])
                tokens[name].append(reply["token"])
            if i % 8 == 7:
                r = statistics.median(a / b for a, b in zip(times["ours"], times["vllm"]))
                print(f"  {i + 1} prompts: median ours/vLLM {r:.3f}", flush=True)
        load.append(os.getloadavg()[0])
    finally:
        for w in workers.values():
            w.close()
    lengths = [len(p) for p in prompts]
    pairs = [(name, "vllm") for name, _, _ in systems if name != "vllm"]
    pairs += [("ours", name) for name, _, _ in systems if name.startswith("ours@")]
    summaries = {f"{a} / {b}": summarize(lengths, times[a], times[b]) for a, b in pairs}
    report = {
        "benchmark": "prefill_paired",
        "workload": {
            "model": Path(args.model_dir).name,
            "dtype": "float32",
            "num_prompts": len(prompts),
            "prompt_len": [lo, hi],
            "output_tokens": 1,
            "gap_s": args.gap,
            "order": f"rotating per prompt over {[name for name, _, _ in systems]}",
            "trees": args.tree,
        },
        "machine": {"cpu": cpu_isa.cpu_model(), "threads": args.threads, "load_avg_1m": load},
        "time_ratios": summaries,
        "first_tokens_identical_to_vllm": {
            name: sum(a == b for a, b in zip(tokens[name], tokens["vllm"]))
            for name, _, _ in systems
            if name != "vllm"
        },
        "prompt_lengths": lengths,
        "ms": times,
    }
    for pair, summary in summaries.items():
        print(f"\n{pair}")
        print(f"{'band':>10} {'n':>4} {'ratio':>7} {'95% of median':>16} {'ms':>8} {'ms':>8}")
        for band, x in summary.items():
            print(
                f"{band:>10} {x['prompts']:4d} {x['median_ratio']:7.3f} "
                f"{str(x['median_ratio_95']):>16} {x['first_median_ms']:8.1f} "
                f"{x['second_median_ms']:8.1f}"
            )
    print(f"first tokens identical to vLLM's: {report['first_tokens_identical_to_vllm']}")
    if args.out:
        path = RESULTS / f"{args.out}.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
