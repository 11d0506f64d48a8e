"""Serving calibration: what a step costs in a serving replica beyond `Engine.step` alone.

A profile times `Engine.step` in a quiet process. Serving adds work the engine does not see:
each token travels from the engine thread through the replica's event loop, Ray's streaming and
the ingress to the HTTP proxy, and on a small host those processes share the cores with the
engines (and the engines with each other). This measures it against a running cluster
(`stepserve profile --calibrate-url URL --replicas N`, or bench/sim_fidelity.py): closed-loop
streams of fixed shape at a few concurrencies, whose median time per output token is a serving
replica's decode step at that batch b (the concurrency over the replicas). Its difference to the
profile's price of the same decode step, extra(b), is the serving overhead of a step that
streams b tokens; the simulator prices every step as

    serving step = Engine.step (the profile) + extra(tokens the step streams)

with extra interpolated piecewise-linearly between the measured batches (flat below the first,
along the last segment beyond the last, never below 0) (`SimSettings.serving`). The overhead is
not linear in b (Ray and the ingress pass a step's tokens on together). Prefill is priced
apart: with every replica prefilling at once (closed-loop prompts of 256 and 1024 tokens,
max_tokens 1, one stream per replica) the TTFT less the path latency, over the profile's price
of that prefill, is `prefill_scale`, applied to the prefill part of every step (what compute
costs when the host's other cores are busy too: the profile ran beside idle ones). The
one-way path latency (client -> replica) is measured on idle single requests, as the TTFT of a
short prompt less its predicted prefill step, halved.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from sim.profile import Profile, StepShape

CONCURRENCIES = (2, 4, 8, 16, 32, 64)


async def _stream(client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """One streamed completion: (TTFT, seconds per output token after the first, tokens)."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    first = None
    n = 0
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or '"token_ids"' not in line:
                continue
            import json

            data = line[5:].strip()
            if data == "[DONE]":
                break
            for choice in json.loads(data).get("choices") or []:
                k = len(choice.get("token_ids") or [])
                if k and first is None:
                    first = time.perf_counter()
                n += k
    end = time.perf_counter()
    ttft = (first or end) - t0
    return ttft, (end - (first or end)) / max(n - 1, 1), n


async def _closed_loop(
    base_url: str,
    concurrency: int,
    prompt_len: int,
    out_len: int,
    seconds: float,
    seed: int,
    at_least_one: bool = False,
) -> list[tuple[float, float, int]]:
    """`concurrency` streams of random prompts, each sent when the last ended, for `seconds`
    (and until one has ended, with `at_least_one`): (TTFT, time per token, tokens) of each."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(seed)
    samples: list[tuple[float, float, int]] = []
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=300) as client:

        async def worker() -> None:
            while time.perf_counter() < deadline or (at_least_one and not samples):
                prompt = [rng.randrange(10, 500) for _ in range(prompt_len)]
                samples.append(await _stream(client, url, prompt, out_len))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


def path_latency(base_url: str, profile: Profile, n: int = 12) -> float:
    """One-way latency outside the engine: (TTFT of a 16-token prompt, max_tokens 1, at idle,
    less the profile's price of its prefill step) / 2, median of n sequential requests."""
    import httpx

    step = profile.model.predict(StepShape.of([(16, 0)], []))
    url = base_url.rstrip("/") + "/v1/completions"

    async def run() -> list[float]:
        out = []
        async with httpx.AsyncClient(timeout=60) as client:
            for i in range(n + 2):
                prompt = [random.Random(i).randrange(10, 500) for _ in range(16)]
                ttft, _, _ = await _stream(client, url, prompt, 1)
                if i >= 2:  # the first ones warm the path
                    out.append(ttft)
                await asyncio.sleep(0.2)
        return out

    return max(0.0, (statistics.median(asyncio.run(run())) - step) / 2)


def serving_step(serving: dict, model, shape: StepShape, streamed: int) -> float:
    """A step's serving time: the profile's price, its prefill part times `prefill_scale`, and
    the overhead of the tokens it streams."""
    t = model.predict(shape)
    scale = serving.get("prefill_scale", 1.0)
    if scale != 1.0 and shape.tokens > shape.decodes:
        t += (scale - 1.0) * max(0.0, t - model.predict(shape.decode_part()))
    return t + serving_extra(serving, streamed)


def serving_extra(serving: dict, streamed: int) -> float:
    """The calibration's serving overhead of a step that streams `streamed` tokens."""
    xs, ys = serving["batches"], serving["extra_s"]
    if streamed <= xs[0] or len(xs) == 1:
        return ys[0]
    for i in range(1, len(xs)):
        if streamed <= xs[i]:
            w = (streamed - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return max(0.0, ys[-1] + slope * (streamed - xs[-1]))


def measure_serving(
    base_url: str,
    profile: Profile,
    replicas: int,
    concurrencies: tuple[int, ...] = CONCURRENCIES,
    prompt_len: int = 64,
    out_len: int = 48,
    seconds: float = 12.0,
    seed: int = 0,
    progress=print,
) -> dict:
    """The serving calibration of a running cluster of `replicas` (module docstring)."""
    rows = []
    for c in concurrencies:
        streams = asyncio.run(_closed_loop(base_url, c, prompt_len, out_len, seconds, seed + c))
        tpots = [tpot for _, tpot, n in streams if n > 1]
        if not tpots:
            continue
        batch = max(1, round(c / replicas))
        ctx = prompt_len + out_len // 2
        predicted = profile.model.predict(StepShape.of([], [ctx] * batch))
        real = statistics.median(tpots)
        rows.append({"concurrency": c, "batch": batch, "predicted_s": predicted, "real_s": real})
        progress(
            f"  concurrency {c:3d} (batch ~{batch}): serving step {real * 1e3:7.2f} ms, "
            f"Engine.step {predicted * 1e3:7.2f} ms"
        )
    if len(rows) < 2:
        raise RuntimeError("serving calibration needs at least 2 concurrency levels that ran")
    latency = path_latency(base_url, profile)
    scales = []
    for prompt in (256, 1024):
        streams = asyncio.run(
            _closed_loop(base_url, replicas, prompt, 1, seconds, seed + prompt, at_least_one=True)
        )
        ttfts = [ttft for ttft, _, _ in streams]
        predicted = profile.model.predict(StepShape.of([(prompt, 0)], []))
        if ttfts and predicted > 0:
            scale = max(1.0, (statistics.median(ttfts) - 2 * latency) / predicted)
            scales.append(scale)
            progress(
                f"  prefill {prompt:5d} tokens, {replicas} at once: TTFT "
                f"{statistics.median(ttfts) * 1e3:8.1f} ms, Engine.step {predicted * 1e3:8.1f} "
                f"ms: x{scale:.2f}"
            )
    by_batch: dict[int, list[float]] = {}
    for r in rows:
        by_batch.setdefault(r["batch"], []).append(max(0.0, r["real_s"] - r["predicted_s"]))
    batches = sorted(by_batch)
    return {
        "prefill_scale": statistics.median(scales) if scales else 1.0,
        "batches": batches,
        "extra_s": [statistics.median(by_batch[b]) for b in batches],
        "path_latency_s": latency,
        "replicas": replicas,
        "points": rows,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
