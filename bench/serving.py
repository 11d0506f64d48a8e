"""HTTP load generator for any OpenAI-compatible server (/v1/completions or
/v1/chat/completions, streaming): open-loop arrivals at a request rate (gamma inter-arrivals:
burstiness 1 is Poisson, < 1 burstier, > 1 more regular) or a fixed concurrency, over token-id
datasets (random, prefix repetition, long-tailed outputs, a short/long heterogeneous mix).
Reports TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99), request and token
throughput, and goodput under SLOs; writes JSON.

Run: .venv/bin/python bench/serving.py --base-url http://127.0.0.1:8000 --dataset random \
        --num-prompts 200 --request-rate 4 --result-file bench/results/serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sim.workloads import (  # noqa: E402,F401  (the datasets live with the simulator's workloads)
    DEFAULT_TOKEN_RANGE,
    RequestSpec,
    arrival_offsets,
    heterogeneous_dataset,
    long_tail_dataset,
    prefix_repetition_dataset,
    random_dataset,
)

PERCENTILES = (90.0, 99.0)  # the median is always reported


# -- one request ----------------------------------------------------------------------------------
@dataclass
class RequestResult:
    kind: str
    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    start: float = 0.0  # seconds since the run started
    sent_at: float = 0.0  # time.perf_counter() when sent (CLOCK_MONOTONIC on Linux: a server's
    # time.monotonic() on the same host, for lining requests up with a server-side trace)
    ttft: float = 0.0
    e2e: float = 0.0
    output_len: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


def request_body(
    spec: RequestSpec, endpoint: str, model: str | None, extra: dict, chat_text
) -> dict:
    body: dict = {
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": chat_text(spec.prompt_ids)}]
    else:
        body["prompt"] = spec.prompt_ids
    body.update(extra)
    return body


async def sse_events(resp: aiohttp.ClientResponse):
    """The JSON events of an SSE response, up to `[DONE]`."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


async def send_request(
    session: aiohttp.ClientSession, url: str, body: dict, spec: RequestSpec, t_zero: float
) -> RequestResult:
    """POST one streaming request; TTFT is the first chunk that carries text (or token ids,
    when the body asks for them: `return_token_ids`), ITL the gaps between such chunks,
    output_len the server's usage count (chunks if it sends none). A token whose text the
    server holds back (an incomplete UTF-8 character, a possible stop string) still counts
    with token ids: the simulator's first token is the engine's, not the first text."""
    result = RequestResult(spec.kind, len(spec.prompt_ids), spec.output_len)
    start = time.perf_counter()
    result.start = start - t_zero
    result.sent_at = start
    last = start
    chunks = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for event in sse_events(resp):
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))[:200]
                    return result
                if event.get("usage"):
                    result.output_len = int(event["usage"].get("completion_tokens") or 0)
                for choice in event.get("choices") or []:
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content")
                    if not text and not choice.get("token_ids"):
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
        result.e2e = time.perf_counter() - start
        if result.output_len == 0:
            result.output_len = chunks
        if chunks == 0:  # nothing but empty deltas: count the first token at the end
            result.ttft = result.e2e
        result.success = True
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    return result


# -- a run --------------------------------------------------------------------------------------
@dataclass
class LoadConfig:
    base_url: str
    endpoint: str = "completions"  # or "chat"
    model: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0
    # a new connection per request (a server that closes kept-alive connections, llama-server,
    # otherwise fails requests sent on a socket it has just closed)
    force_close: bool = False
    extra_body: dict = field(default_factory=dict)
    tokenizer: str | None = None  # chat prompts: decode token ids with it (else synthetic words)


def _chat_text_fn(tokenizer: str | None):
    """Chat messages are text: decode the token-id prompt with `tokenizer` (a directory, or
    `tiny` / `default` for the benchmark models), or spell it as words w<id> without one."""
    if tokenizer is None:
        return lambda ids: " ".join(f"w{t}" for t in ids)
    from transformers import AutoTokenizer

    if tokenizer in ("tiny", "default"):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from bench._models import model_dir

        tokenizer = str(model_dir(tokenizer))
    tok = AutoTokenizer.from_pretrained(tokenizer)
    return lambda ids: tok.decode(ids)


async def run_load(
    cfg: LoadConfig, specs: Sequence[RequestSpec], offsets: Sequence[float] | None = None
) -> tuple[list[RequestResult], float]:
    """Send `specs` per the arrival process (or at the given `offsets`, seconds from the start:
    a trace's times); returns results (in spec order) and wall time."""
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    url = cfg.base_url.rstrip("/") + path
    chat_text = _chat_text_fn(cfg.tokenizer)
    bodies = [request_body(s, cfg.endpoint, cfg.model, cfg.extra_body, chat_text) for s in specs]
    if offsets is None:
        offsets = arrival_offsets(
            len(specs), cfg.request_rate, cfg.burstiness, random.Random(cfg.seed)
        )
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0, force_close=cfg.force_close)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t_zero = time.perf_counter()

        async def one(i: int) -> RequestResult:
            delay = t_zero + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                return await send_request(session, url, bodies[i], specs[i], t_zero)
            async with limit:
                return await send_request(session, url, bodies[i], specs[i], t_zero)

        results = await asyncio.gather(*(one(i) for i in range(len(specs))))
        duration = time.perf_counter() - t_zero
    return list(results), duration


@dataclass
class TurnResult:
    """One conversation turn sent by `run_conversations`: its result, the prompt sent, when it
    was sent and ended (s from the run's start) and the token ids the server generated."""

    result: RequestResult
    prompt_ids: list[int]
    sent_s: float
    done_s: float
    answer_ids: list[int]


async def send_turn(
    session: aiohttp.ClientSession, url: str, body: dict, spec: RequestSpec, t_zero: float
) -> tuple[RequestResult, list[int]]:
    """`send_request` for a streamed completion with return_token_ids: also collects the ids."""
    result = RequestResult(spec.kind, len(spec.prompt_ids), spec.output_len)
    ids: list[int] = []
    start = time.perf_counter()
    result.start = start - t_zero
    last = start
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result, ids
            async for event in sse_events(resp):
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))[:200]
                    return result, ids
                for choice in event.get("choices") or []:
                    new = choice.get("token_ids") or []
                    if not new:
                        continue
                    now = time.perf_counter()
                    if not ids:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    ids.extend(new)
        result.e2e = time.perf_counter() - start
        result.output_len = len(ids)
        result.success = bool(ids)
        if not ids:
            result.error = "no tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    return result, ids


async def run_conversations(
    base_url: str, conversations, model: str | None = None, timeout_s: float = 600.0
) -> tuple[list[TurnResult], float]:
    """Closed-loop chats (sim.workloads.Conversation): each starts at its start time; each
    turn's prompt is the whole history with the answers the server actually generated
    (return_token_ids), sent after the previous answer and the user's think time."""
    url = base_url.rstrip("/") + "/v1/completions"
    out: list[TurnResult] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t_zero = time.perf_counter()

        async def chat(conv) -> None:
            delay = t_zero + conv.start_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            answers: list[list[int]] = []
            for k, turn in enumerate(conv.turns):
                spec = conv.spec(k, answers)
                body = {
                    "prompt": spec.prompt_ids, "max_tokens": turn.output_len, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True,
                }  # fmt: skip
                if model:
                    body["model"] = model
                sent = time.perf_counter() - t_zero
                result, ids = await send_turn(session, url, body, spec, t_zero)
                done = time.perf_counter() - t_zero
                out.append(TurnResult(result, spec.prompt_ids, sent, done, ids))
                if not result.success:
                    return
                answers.append(ids)
                await asyncio.sleep(turn.think_s)

        await asyncio.gather(*(chat(c) for c in conversations))
        duration = time.perf_counter() - t_zero
    return out, duration


async def fetch_model(base_url: str) -> str | None:
    """The first model the server lists (None if it lists none)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
            data = (await resp.json()).get("data") or []
            return data[0]["id"] if data else None


# -- statistics ---------------------------------------------------------------------------------
def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def describe_ms(samples: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict:
    """mean / median / p* of seconds, in milliseconds."""
    if not samples:
        return {"mean": None, "median": None, **{f"p{q:g}": None for q in percentiles}}
    out = {
        "mean": round(1000 * statistics.fmean(samples), 3),
        "median": round(1000 * statistics.median(samples), 3),
    }
    for q in percentiles:
        out[f"p{q:g}"] = round(1000 * percentile(samples, q), 3)
    return out


def parse_slos(text: str | None) -> dict[str, float]:
    """'ttft:500 tpot:50 e2el:5000' (milliseconds) -> {"ttft": 0.5, ...} in seconds."""
    slos: dict[str, float] = {}
    for item in (text or "").split():
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"bad SLO {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        slos[name] = float(value) / 1000.0
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    if not r.success:
        return False
    if "ttft" in slos and r.ttft > slos["ttft"]:
        return False
    if "e2el" in slos and r.e2e > slos["e2el"]:
        return False
    tpot = r.tpot
    return not ("tpot" in slos and tpot is not None and tpot > slos["tpot"])


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": round(duration, 3),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(ok) / duration, 4) if duration else None,
        "output_throughput": round(out_tokens / duration, 2) if duration else None,
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 2)
        if duration
        else None,
        "ttft_ms": describe_ms([r.ttft for r in ok], percentiles),
        "tpot_ms": describe_ms([t for r in ok if (t := r.tpot) is not None], percentiles),
        "itl_ms": describe_ms([x for r in ok for x in r.itl], percentiles),
        "e2el_ms": describe_ms([r.e2e for r in ok], percentiles),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in results)
        summary["goodput"] = {
            "slos_ms": {k: v * 1000 for k, v in slos.items()},
            "good_requests": good,
            "request_goodput": round(good / duration, 4) if duration else None,
        }
    kinds = sorted({r.kind for r in results})
    if 1 < len(kinds) <= 8:  # per-class breakdown (short / long); not one per prefix
        summary["by_kind"] = {
            kind: {
                "completed": sum(1 for r in ok if r.kind == kind),
                "ttft_ms": describe_ms([r.ttft for r in ok if r.kind == kind], percentiles),
                "e2el_ms": describe_ms([r.e2e for r in ok if r.kind == kind], percentiles),
            }
            for kind in kinds
        }
    errors = [r.error for r in results if not r.success]
    if errors:
        summary["first_errors"] = errors[:3]
    return summary


def per_request(results: Sequence[RequestResult]) -> dict:
    """Column arrays of the per-request numbers (for plots and re-analysis)."""
    return {
        "kind": [r.kind for r in results],
        "success": [r.success for r in results],
        "start_s": [round(r.start, 4) for r in results],
        "sent_at": [round(r.sent_at, 6) for r in results],
        "prompt_len": [r.prompt_len for r in results],
        "output_len": [r.output_len for r in results],
        "ttft_s": [round(r.ttft, 5) for r in results],
        "e2e_s": [round(r.e2e, 5) for r in results],
    }


def print_summary(title: str, s: dict) -> None:
    print(f"== {title} ==")
    print(
        f"  completed {s['completed']}  failed {s['failed']}  in {s['duration_s']:.1f} s: "
        f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s"
    )
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        m = s[name]
        if m["median"] is None:
            continue
        tail = "  ".join(f"{k} {v:9.1f}" for k, v in m.items() if k not in ("mean", "median"))
        print(f"  {name[:-3]:>5} ms: mean {m['mean']:9.1f}  median {m['median']:9.1f}  {tail}")
    if "goodput" in s:
        g = s["goodput"]
        print(
            f"  goodput {g['request_goodput']:.2f} req/s ({g['good_requests']} met {g['slos_ms']})"
        )
    for kind, k in (s.get("by_kind") or {}).items():
        t = k["ttft_ms"]
        if t["median"] is not None:
            print(
                f"  [{kind}] n={k['completed']} ttft median {t['median']:.1f} p99 {t['p99']:.1f} ms"
            )
    for err in s.get("first_errors", []):
        print(f"  error: {err}")


def machine_info() -> dict:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


# -- command line -------------------------------------------------------------------------------
def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset (token-id prompts)")
    g.add_argument(
        "--dataset",
        choices=["random", "prefix-repetition", "long-tail", "heterogeneous"],
        default="random",
    )
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--random-input-len", type=int, default=128)
    g.add_argument("--random-output-len", type=int, default=64)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--num-prefixes", type=int, default=8)
    g.add_argument("--prefix-len", type=int, default=256)
    g.add_argument("--suffix-len", type=int, default=32)
    g.add_argument("--prefix-output-len", type=int, default=16)
    g.add_argument("--tail-input-len", type=int, default=64)
    g.add_argument("--tail-output-median", type=int, default=32)
    g.add_argument("--tail-output-max", type=int, default=512)
    g.add_argument("--tail-sigma", type=float, default=1.0)
    g.add_argument("--long-fraction", type=float, default=0.15)
    g.add_argument("--short-len", default="32,16", help="short requests: input,output means")
    g.add_argument("--long-len", default="1024,256", help="long requests: input,output means")
    g.add_argument("--token-id-range", default="10,500", help="prompt token ids: low,high")


def _pair(text: str) -> tuple[int, int]:
    a, b = (int(x) for x in text.split(","))
    return a, b


# A sweep's i-th rate draws its prompts with seed + i * SWEEP_SEED_STRIDE, so no rate replays
# another's prompts (a server with a prefix cache would find them cached and answer the later
# rates' first tokens from it); --same-prompts keeps one set for every rate.
SWEEP_SEED_STRIDE = 7919


def sweep_seed(seed: int, index: int, same_prompts: bool = False) -> int:
    """The seed of a sweep's `index`-th rate: its prompts and its arrival times."""
    return seed if same_prompts else seed + index * SWEEP_SEED_STRIDE


def build_dataset(args: argparse.Namespace, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    tr = _pair(args.token_id_range)
    n = args.num_prompts
    if args.dataset == "random":
        return random_dataset(
            n, args.random_input_len, args.random_output_len, args.random_range_ratio, rng, tr
        )
    if args.dataset == "prefix-repetition":
        return prefix_repetition_dataset(
            n, args.num_prefixes, args.prefix_len, args.suffix_len, args.prefix_output_len, rng, tr
        )
    if args.dataset == "long-tail":
        return long_tail_dataset(
            n,
            args.tail_input_len,
            args.tail_output_median,
            args.tail_output_max,
            args.tail_sigma,
            rng,
            tr,
        )
    return heterogeneous_dataset(
        n, args.long_fraction, _pair(args.short_len), _pair(args.long_len), rng, tr
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", help="model name to send (default: the server's first model)")
    p.add_argument(
        "--tokenizer",
        help="chat endpoint: decode token-id prompts with this tokenizer (dir, tiny or default)",
    )
    p.add_argument(
        "--request-rate",
        default="inf",
        help="requests/s; 'inf' sends all at once; a comma list runs a sweep (e.g. 1,2,4)",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument("--goodput", help="SLOs in ms, e.g. 'ttft:500 tpot:50 e2el:5000'")
    p.add_argument("--percentiles", default="90,99", help="besides mean and median")
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    p.add_argument("--label", default="server", help="name of the system under test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--same-prompts",
        action="store_true",
        help="send the same prompts at every rate of a sweep (by default each rate draws its "
        "own, so a prefix cache cannot answer a later rate from an earlier one's prompts)",
    )
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--force-close", action="store_true", help="a new connection per request")
    p.add_argument("--result-file", help="write the results as JSON here")
    p.add_argument("--save-detailed", action="store_true", help="per-request columns in the JSON")
    p.add_argument("--quick", action="store_true", help="a 20-prompt smoke run")
    add_dataset_args(p)
    args = p.parse_args()
    if args.quick:
        args.num_prompts = min(args.num_prompts, 20)
    slos = parse_slos(args.goodput)
    percentiles = [float(x) for x in args.percentiles.split(",")]
    rates = [float(x) for x in args.request_rate.split(",")]
    model = args.model or asyncio.run(fetch_model(args.base_url))
    runs = []
    for i, rate in enumerate(rates):
        seed = sweep_seed(args.seed, i, args.same_prompts)
        specs = build_dataset(args, seed)
        cfg = LoadConfig(
            base_url=args.base_url,
            endpoint=args.endpoint,
            model=model,
            request_rate=rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            seed=seed,
            timeout_s=args.timeout_s,
            force_close=args.force_close,
            extra_body=json.loads(args.extra_body),
            tokenizer=args.tokenizer,
        )
        results, duration = asyncio.run(run_load(cfg, specs))
        summary = summarize(results, duration, slos, percentiles)
        print_summary(f"{args.label} @ {rate:g} req/s ({args.dataset}, {args.endpoint})", summary)
        run = {"request_rate": rate, "seed": seed, **summary}
        if args.save_detailed:
            run["requests"] = per_request(results)
        runs.append(run)
    if args.result_file:
        out = {
            "benchmark": "serving",
            "label": args.label,
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "model": model,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "dataset": {
                k: v for k, v in vars(args).items() if k not in ("base_url", "result_file")
            },
            "host": machine_info(),
            "runs": runs,
        }
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.result_file}")


if __name__ == "__main__":
    sys.exit(main())
