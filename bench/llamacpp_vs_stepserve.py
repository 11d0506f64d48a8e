"""stepserve against llama.cpp on the same GGUF file and the same cores, side by side in one run.

Stages (`--stages`, any of):
  kernels  single-stream decode tok/s and prompt processing tok/s at 128 and 512 tokens:
           llama-bench (-t THREADS) against our offline engine (one request, speculative
           decoding and prefix caching off), alternating, `--repeats` rounds, medians;
  served   llama-server (continuous batching, `--slots` parallel slots) against `stepserve
           serve` (as shipped, and with prompt-lookup drafts off), each started in turn and swept over `--concurrency` closed-loop streams of
           random token-id prompts (bench/serving.py): output tok/s, TTFT and TPOT p50/p99;
  nll      mean NLL of a fixed text's second half given its first (2048 tokens, llama.cpp's
           tokens): llama-perplexity's figure against our prompt_logprobs on the GGUF (int8 and
           fp32 activations) and on the fp32 de-quantized reference of the same file.

llama.cpp's tools come from bench/llamacpp_build.sh (`--llamacpp-bin DIR`). Writes
bench/results/<out>.json. Example:
    .venv/bin/python bench/llamacpp_vs_stepserve.py --gguf default --llamacpp-bin \
        ~/.cache/stepserve/llamacpp/build/bin --out llamacpp_q4_1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serving import machine_info  # noqa: E402
from bench.serving_vs_peer import run_serving, stop, wait_healthy, wait_port_free  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DEFAULT_BIN = Path(os.environ.get("STEPSERVE_CACHE", Path.home() / ".cache" / "stepserve"))
DEFAULT_BIN = DEFAULT_BIN / "llamacpp" / "build" / "bin"
DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")


def gguf_path(name: str, args) -> Path:
    """`default` (the default model's Q4_1 file), `default-q8_0` (that file re-quantized to
    Q8_0 by llama-quantize, once, into the cache) or a .gguf path."""
    from replica.default_model import cache_root, find_gguf_file

    if name == "default":
        return find_gguf_file()
    if name == "default-q8_0":
        out = cache_root() / "gguf-bench" / "SmolLM2-135M-Instruct.Q8_0.gguf"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            argv = [tool(args, "llama-quantize"), "--allow-requantize", str(find_gguf_file())]
            subprocess.run([*argv, str(out), "Q8_0"], check=True, capture_output=True)
        return out
    path = Path(name).expanduser().resolve()
    if not path.is_file():
        raise SystemExit(f"--gguf {name!r}: no such file")
    return path


def tool(args, name: str) -> str:
    path = Path(args.llamacpp_bin).expanduser() / name
    if not path.is_file():
        raise SystemExit(f"{path} missing: build llama.cpp with bench/llamacpp_build.sh")
    return str(path)


# -- kernels: llama-bench against our offline engine --------------------------------------------
def llama_bench(args, gguf: Path) -> dict[str, float]:
    argv = [tool(args, "llama-bench"), "-m", str(gguf), "-t", str(args.threads), "-r", "1"]
    argv += ["-p", "128,512", "-n", str(args.decode_tokens), "-o", "json"]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    figures = {}
    for row in json.loads(out):
        name = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        figures["decode" if name.startswith("tg") else name] = float(row["avg_ts"])
    return figures


OURS_KERNELS = r"""
import json, sys, time
import torch
from replica.engine.llm import LLM
from replica.request import SamplingParams
model, decode_tokens, fields = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
threads = int(sys.argv[4])
fields = {"num_speculative_tokens": 0, "enable_prefix_caching": False} | fields
torch.set_num_threads(threads)
with LLM(model, **fields) as llm:
    def prompt(n, salt):
        return [100 + (salt * 7919 + i * 104729) % 20000 for i in range(n)]
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate([prompt(64, 0)], greedy(8))  # warm-up
    out = {}
    for n in (128, 512):
        times = []
        for salt in range(1, 4):
            t = time.perf_counter(); llm.generate([prompt(n, salt + n)], greedy(1))
            times.append(time.perf_counter() - t)
        out[f"pp{n}"] = n / min(times)
    t = time.perf_counter(); llm.generate([prompt(16, 99)], greedy(1)); one = time.perf_counter() - t
    t = time.perf_counter(); llm.generate([prompt(16, 98)], greedy(decode_tokens + 1))
    out["decode"] = decode_tokens / (time.perf_counter() - t - one)
print("RESULT " + json.dumps(out))
"""


def ours_kernels(args, gguf: Path, fields: dict) -> dict[str, float]:
    env = dict(os.environ) | {"OMP_NUM_THREADS": str(args.threads)}
    argv = [sys.executable, "-c", OURS_KERNELS, str(gguf), str(args.decode_tokens)]
    argv += [json.dumps(fields), str(args.threads)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def stage_kernels(args, gguf: Path) -> dict:
    systems = {"llama.cpp": lambda: llama_bench(args, gguf)}
    for variant in args.ours:
        fields = {"quant_activations": variant}
        systems[f"stepserve[{variant}]"] = lambda f=fields: ours_kernels(args, gguf, f)
    rounds: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(args.repeats):
        order = list(systems)[r % len(systems) :] + list(systems)[: r % len(systems)]
        for name in order:
            figures = systems[name]()
            print(f"round {r} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
            rounds[name].append(figures)
    medians = {
        name: {k: round(statistics.median(f[k] for f in runs), 1) for k in runs[0]}
        for name, runs in rounds.items()
    }
    base = medians["llama.cpp"]
    ratios = {
        name: {k: round(v / base[k], 3) for k, v in m.items()}
        for name, m in medians.items()
        if name != "llama.cpp"
    }
    return {"tok_per_s": medians, "ratio_vs_llamacpp": ratios, "rounds": rounds}


# -- served: llama-server against stepserve serve -----------------------------------------------
def server_argv(args, system: str, gguf: Path, port: int) -> list[str]:
    if system == "llama.cpp":
        ctx = args.slots * (args.input_len + args.output_len + 64)
        argv = [tool(args, "llama-server"), "-m", str(gguf), "-t", str(args.threads)]
        argv += ["-tb", str(args.threads), "-np", str(args.slots), "-c", str(ctx)]
        return argv + ["--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    argv = [str(ROOT / ".venv" / "bin" / "stepserve"), "serve", "--model", str(gguf)]
    if system == "stepserve-nospec":  # prompt-lookup drafts off: llama-server has none either
        argv += ["--num-speculative-tokens", "0"]
    return argv + ["--host", "127.0.0.1", "--port", str(port)] + args.stepserve_args.split()


def stage_served(args, gguf: Path, workdir: Path) -> dict:
    runs: dict[str, list[dict]] = {}
    for system in args.served_systems:
        log = workdir / f"{system}.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                server_argv(args, system, gguf, args.port), stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        base = f"http://127.0.0.1:{args.port}"
        try:
            wait_healthy(base, proc, args.startup_timeout_s, log)
            data = ["--dataset", "random", "--random-input-len", str(args.input_len)]
            data += ["--random-output-len", str(args.output_len), "--request-rate", "inf"]
            data += ["--force-close"]  # the same client for both: llama-server drops kept-alive
            run_serving(
                base, f"{system} warm-up", [*data, "--num-prompts", "8", "--seed", "7"], None
            )
            for c in args.concurrency:
                n = max(args.min_prompts, args.prompts_per_stream * c)
                result = workdir / f"{system}-{c}.json"
                more = ["--num-prompts", str(n), "--max-concurrency", str(c), "--seed", str(c)]
                summary = run_serving(base, f"{system} c={c}", [*data, *more], result)
                runs.setdefault(system, []).append({"concurrency": c} | compact(summary))
        finally:
            stop(proc)
            wait_port_free(args.port)
    return runs


def compact(summary: dict) -> dict:
    """Output tok/s, TTFT and TPOT p50/p99 (ms) and failures of a bench/serving.py summary."""
    s = summary["runs"][0]

    def pick(name: str) -> dict:
        d = s.get(name) or {}
        return {"p50": d.get("median"), "p99": d.get("p99")}

    return {
        "output_tok_s": s.get("output_throughput"),
        "ttft_ms": pick("ttft_ms"),
        "tpot_ms": pick("tpot_ms"),
        "failed": s.get("failed", 0),
    }


# -- nll: llama-perplexity against our prompt_logprobs -----------------------------------------
def text_tokens(args, gguf: Path, n: int) -> list[int]:
    argv = [tool(args, "llama-tokenize"), "-m", str(gguf), "-f", str(args.text), "--ids"]
    argv += ["--log-disable"]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    ids = json.loads(out.strip().splitlines()[-1])
    if len(ids) < n:
        raise SystemExit(f"{args.text} gives {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def llama_nll(args, gguf: Path, n: int) -> float:
    argv = [tool(args, "llama-perplexity"), "-m", str(gguf), "-f", str(args.text)]
    argv += ["-c", str(n), "-b", str(n), "--chunks", "1", "-t", str(args.threads)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not found:
        raise RuntimeError("llama-perplexity printed no final estimate:\n" + out.stderr[-2000:])
    return math.log(float(found.group(1)))


OURS_NLL = r"""
import json, sys
from replica.engine.llm import LLM
from replica.request import SamplingParams
model, ids, fields = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
with LLM(model, max_model_len=len(ids) + 8, **fields) as llm:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = llm.generate([ids], params)[0]
# prompt_logprobs[i] is token ids[i + 1]'s; llama-perplexity scores the second half
half = len(ids) // 2
lps = [lp for lp, _ in out.prompt_logprobs[half:]]  # tokens half+1 .. n-1, as llama.cpp
print("RESULT " + json.dumps(-sum(lps) / len(lps)))
"""


def ours_nll(model: str, ids: list[int], fields: dict, env: dict | None = None) -> float:
    argv = [sys.executable, "-c", OURS_NLL, model, json.dumps(ids), json.dumps(fields)]
    out = subprocess.run(
        argv,
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    return json.loads(out.stdout.split("RESULT ", 1)[1])


def stage_nll(args, gguf: Path) -> dict:
    n = args.nll_tokens
    ids = text_tokens(args, gguf, n)
    figures = {"llama.cpp": llama_nll(args, gguf, n)}
    for variant in args.ours:
        # the prompt through the quantized kernels at every chunk, as decode runs (not the
        # de-quantize + GEMM path of long prefills, whose crossover is per host: down to 32 rows)
        fields = {"quant_activations": variant, "max_num_batched_tokens": args.nll_chunk}
        figures[f"stepserve[{variant}]"] = ours_nll(
            str(gguf), ids, fields, {"STEPSERVE_QUANT_CROSSOVER": str(1 << 30)}
        )
    reference = args.reference or dequantized_reference(gguf)
    figures["fp32 de-quantized reference"] = ours_nll(str(reference), ids, {"dtype": "float32"})
    ref = figures["fp32 de-quantized reference"]
    return {
        "tokens": n,
        "chunk": args.nll_chunk,
        "text": str(args.text),
        "mean_nll": {k: round(v, 5) for k, v in figures.items()},
        "relative_to_reference": {k: round(v / ref - 1, 5) for k, v in figures.items()},
        "relative_to_llamacpp": {
            k: round(v / figures["llama.cpp"] - 1, 5) for k, v in figures.items()
        },
    }


def dequantized_reference(gguf: Path) -> Path:
    """An fp32 HF directory of the file's de-quantized weights (transformers' GGUF reader), made
    once into the cache."""
    from replica.default_model import _convert, cache_root

    out = cache_root() / "gguf-bench" / f"{gguf.stem}-fp32"
    if not (out / "config.json").is_file():
        _convert(gguf, out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--gguf", default="default", help="a .gguf file, `default` (Q4_1) or `default-q8_0`"
    )
    p.add_argument("--llamacpp-bin", default=str(DEFAULT_BIN))
    p.add_argument("--stages", default="kernels,served,nll")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--ours", default="int8,fp32", help="quant_activations variants of ours")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument(
        "--served-systems",
        default="llama.cpp,stepserve,stepserve-nospec",
        help="stepserve is `stepserve serve` as shipped (prompt-lookup drafts on)",
    )
    p.add_argument("--slots", type=int, default=32, help="llama-server parallel slots")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-stream", type=int, default=3)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--stepserve-args", default="")
    p.add_argument("--port", type=int, default=8041)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    p.add_argument("--nll-tokens", type=int, default=2048)
    p.add_argument("--nll-chunk", type=int, default=128, help="our prefill chunk for the NLL")
    p.add_argument("--reference", help="fp32 HF dir of the file (default: de-quantize it)")
    p.add_argument("--out", default="llamacpp_vs_stepserve")
    args = p.parse_args()
    args.ours = [v for v in args.ours.split(",") if v]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.served_systems = args.served_systems.split(",")
    gguf = gguf_path(args.gguf, args)
    result: dict = {"benchmark": "llamacpp_vs_stepserve", "gguf": str(gguf)}
    result |= {"threads": args.threads, "machine": machine_info()}
    out = RESULTS / f"{args.out}.json"
    stages = args.stages.split(",")
    with tempfile.TemporaryDirectory(prefix="llamacpp-vs-") as tmp:
        for stage in stages:
            started = time.time()
            if stage == "kernels":
                result["kernels"] = stage_kernels(args, gguf)
            elif stage == "served":
                result["served"] = stage_served(args, gguf, Path(tmp))
            elif stage == "nll":
                result["nll"] = stage_nll(args, gguf)
            else:
                raise SystemExit(f"unknown stage {stage!r}: kernels, served, nll")
            print(f"{stage} done in {time.time() - started:.0f} s")
            out.write_text(json.dumps(result, indent=1) + "\n")
    if "kernels" in result or "served" in result:
        from bench.plots import plot_llamacpp

        print(f"wrote {plot_llamacpp(result, out.with_suffix('.png'))}")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1)[:6000])


if __name__ == "__main__":
    main()
