"""A burst no replica can absorb: 1500 concurrent streaming chats (max_tokens 32) against
`stepserve serve` with one replica of the default model, as a new user would send it.

Phase "burst": all at once, the server's default deadline (http.request_timeout_s, 600 s).
Phase "deadline": the same burst again with `X-Request-Timeout: 30` on every request; each
request refused with 429 retries once, after its Retry-After, with the same deadline.

Per request: how it ended (completed, refused with 429, ended by a deadline error, another
error, or a client timeout), when (for a 429: how long the refusal took), its TTFT, the longest
silence its client saw (the longest gap between bytes received, from sending the request to
its end, headers included), and for admitted streams the wait the server expected
(X-Expected-Wait-S) against the TTFT that followed; for a 429 its Retry-After against how
the retry fared.

Writes bench/results/overload.json.
Run: .venv/bin/python bench/overload.py [--requests 1500] [--model default]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serving import machine_info  # noqa: E402
from tests.helpers import free_port  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Why is the sky blue?",
    "Give me a word that rhymes with cat.",
    "What is two plus two?",
]


async def one(session: aiohttp.ClientSession, url: str, i: int, deadline: float | None) -> dict:
    body = {
        "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        "max_tokens": 32,
        "stream": True,
        "temperature": 0,
    }
    headers = {"X-Request-Timeout": str(deadline)} if deadline else {}
    start = time.monotonic()
    last = start
    silence = 0.0
    after_headers = 0.0  # the longest gap once the response had started
    result: dict = {"outcome": None, "ttft": None, "expected_wait": None, "t_headers": None}

    def tick() -> None:
        nonlocal last, silence, after_headers
        now = time.monotonic()
        silence = max(silence, now - last)
        if result["t_headers"] is None:
            result["t_headers"] = now - start
        else:
            after_headers = max(after_headers, now - last)
        last = now

    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            tick()
            if r.status != 200:
                await r.read()
                result["outcome"] = f"http_{r.status}"
                result["retry_after"] = r.headers.get("retry-after")
                result["t_end"] = time.monotonic() - start
                result["silence"] = silence
                result["silence_after_headers"] = after_headers
                return result
            if r.headers.get("x-expected-wait-s"):
                result["expected_wait"] = float(r.headers["x-expected-wait-s"])
            buffer = b""
            async for chunk in r.content.iter_any():
                tick()
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        kind = event["error"].get("type")
                        result["outcome"] = "deadline" if kind == "timeout_error" else "error"
                        result["error"] = event["error"]["message"][:200]
                    for c in event.get("choices", []):
                        if c["delta"].get("content") and result["ttft"] is None:
                            result["ttft"] = time.monotonic() - start
                        if c.get("finish_reason"):
                            result["outcome"] = result["outcome"] or "completed"
            tick()
    except asyncio.TimeoutError:
        result["outcome"] = "client_timeout"
    except aiohttp.ClientError as exc:
        result["outcome"] = f"client_error:{type(exc).__name__}"
    result["outcome"] = result["outcome"] or "ended_without_finish"
    result["t_end"] = time.monotonic() - start
    result["silence"] = silence
    result["silence_after_headers"] = after_headers
    return result


async def burst(url: str, n: int, deadline: float | None, retry: bool) -> list[dict]:
    # aiohttp, not httpx: the client shares the server's 2 vCPUs, and aiohttp spends a
    # fraction of httpx's CPU per request, so less of the intake time measured is the client's
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def with_retry(i: int) -> dict:
            first = await one(session, url, i, deadline)
            if retry and first["outcome"] == "http_429" and first.get("retry_after"):
                wait = float(first["retry_after"])
                await asyncio.sleep(wait)
                first["retry"] = await one(session, url, i, deadline)
            return first

        return await asyncio.gather(*(with_retry(i) for i in range(n)))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(results: list[dict]) -> dict:
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    refused = [r for r in results if r["outcome"] == "http_429"]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    admitted = [r for r in results if r.get("expected_wait") is not None and r["ttft"]]
    summary = {
        "outcomes": outcomes,
        "longest_silence_s": max(r["silence"] for r in results),
        "silence_p99_s": pct([r["silence"] for r in results], 0.99),
        "longest_silence_after_headers_s": max(r["silence_after_headers"] for r in results),
        "time_to_headers_p50_s": pct([r["t_headers"] for r in results if r["t_headers"]], 0.5),
        "time_to_headers_max_s": max((r["t_headers"] or 0) for r in results),
        "refusal_time_max_s": max((r["t_end"] for r in refused), default=None),
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p99_s": pct(ttfts, 0.99),
        "expected_vs_actual_ttft": {
            "n": len(admitted),
            "median_ratio_actual_over_expected": statistics.median(
                r["ttft"] / max(r["expected_wait"], 0.05) for r in admitted
            )
            if admitted
            else None,
        },
    }
    retried = [r for r in refused if "retry" in r]
    if retried:
        retry_outcomes: dict[str, int] = {}
        for r in retried:
            key = r["retry"]["outcome"]
            retry_outcomes[key] = retry_outcomes.get(key, 0) + 1
        summary["retry_after_s"] = {
            "p50": pct([float(r["retry_after"]) for r in retried], 0.5),
            "max": max(float(r["retry_after"]) for r in retried),
        }
        summary["retries"] = retry_outcomes
        summary["retry_ttft_p50_s"] = pct(
            [r["retry"]["ttft"] for r in retried if r["retry"]["ttft"]], 0.5
        )
    return summary


def start_server(port: int, model: str) -> subprocess.Popen:
    stepserve = str(Path(sys.executable).parent / "stepserve")
    cmd = [stepserve, "serve", "--port", str(port), "--replicas", "1"]
    if model != "default":
        cmd += ["--model", model]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(RESULTS / "overload_server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("stepserve serve exited; see bench/results/overload_server.log")
        time.sleep(2)
    raise RuntimeError("server did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--model", default="default")
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument(
        "--phases",
        default="burst,deadline",
        help="burst (no deadline), deadline (X-Request-Timeout, retry after Retry-After); "
        "warmup:N is a burst of N requests to measure the service rate first",
    )
    parser.add_argument("--out", default=str(RESULTS / "overload.json"))
    args = parser.parse_args()
    port = free_port()
    proc = start_server(port, args.model)
    url = f"http://127.0.0.1:{port}"
    report = {"machine": machine_info(), "requests": args.requests, "phases": {}}
    try:
        for phase in args.phases.split(","):
            name, _, count = phase.partition(":")
            n = int(count) if count else args.requests
            deadline, retry = (args.deadline, True) if name == "deadline" else (None, False)
            started = time.monotonic()
            results = asyncio.run(burst(url, n, deadline, retry))
            summary = summarize(results)
            summary["wall_s"] = time.monotonic() - started
            summary["deadline_s"] = deadline or 600.0
            summary["requests"] = n
            report["phases"][name] = summary
            report.setdefault("raw", {})[name] = results
            print(name, json.dumps(summary, indent=1), flush=True)
            time.sleep(5)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
