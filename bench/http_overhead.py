"""What the HTTP + routing path adds per request over calling the engine directly, side by side
in one run: the same requests (token-id prompts, `ignore_eos`, greedy) go one at a time,
alternately, to (a) an in-process AsyncEngine and (b) a 1-replica stepserve cluster over HTTP
(proxy -> ingress -> LoadAwareRouter -> replica -> SSE back), built from the same EngineConfig
and torch thread count. Reports per-request e2e and TTFT, and their paired differences
(median, p99), streaming and non-streaming. Writes bench/results/http_overhead.json + .png.

Run: flock /tmp/stepserve-ray.lock .venv/bin/python bench/http_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402

from bench._cluster import LocalCluster  # noqa: E402
from bench._models import model_dir as resolve_model  # noqa: E402
from bench.serving import (  # noqa: E402
    RequestSpec,
    describe_ms,
    machine_info,
    request_body,
    send_request,
)
from cluster.config import ClusterConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_MEDIAN_MS = 5.0


async def engine_request(engine, spec: RequestSpec) -> tuple[float, float]:
    """(e2e, ttft) in seconds of one request on the in-process AsyncEngine."""
    from replica.request import SamplingParams

    params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ttft = None
    async for out in engine.generate(spec.prompt_ids, params):
        if ttft is None and out.new_token_ids:
            ttft = time.perf_counter() - start
    return time.perf_counter() - start, ttft or 0.0


async def http_request(session, url: str, model: str, spec: RequestSpec, stream: bool):
    body = request_body(spec, "completions", model, {}, None)
    if stream:
        result = await send_request(session, url, body, spec, time.perf_counter())
        if not result.success:
            raise RuntimeError(result.error)
        return result.e2e, result.ttft
    body["stream"] = False
    body.pop("stream_options")
    start = time.perf_counter()
    async with session.post(url, json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(str(data))
    e2e = time.perf_counter() - start
    return e2e, e2e


async def measure(engine, base_url: str, model: str, specs, stream: bool, warmup: int) -> dict:
    url = base_url + "/v1/completions"
    pairs = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for i, spec in enumerate(specs):
            # alternate which side goes first so drift and cache effects hit both equally
            if i % 2 == 0:
                eng = await engine_request(engine, spec)
                http = await http_request(session, url, model, spec, stream)
            else:
                http = await http_request(session, url, model, spec, stream)
                eng = await engine_request(engine, spec)
            if i >= warmup:
                pairs.append((eng, http))
    eng_e2e = [e[0] for e, _ in pairs]
    http_e2e = [h[0] for _, h in pairs]
    added = [h[0] - e[0] for e, h in pairs]
    out = {
        "pairs": len(pairs),
        "engine_e2e_ms": describe_ms(eng_e2e),
        "http_e2e_ms": describe_ms(http_e2e),
        "added_ms": describe_ms(added),
        "difference_of_medians_ms": round(
            1000 * (statistics.median(http_e2e) - statistics.median(eng_e2e)), 3
        ),
        "engine_e2e_s": [round(x, 6) for x in eng_e2e],
        "http_e2e_s": [round(x, 6) for x in http_e2e],
    }
    if stream:
        out["engine_ttft_ms"] = describe_ms([e[1] for e, _ in pairs])
        out["http_ttft_ms"] = describe_ms([h[1] for _, h in pairs])
        out["added_ttft_ms"] = describe_ms([h[1] - e[1] for e, h in pairs])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, default, or a local HF model dir")
    p.add_argument("--num-requests", type=int, default=200, help="measured pairs per mode")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="30 pairs per mode, no files written")
    args = p.parse_args()
    if args.quick:
        args.num_requests = 30
    import torch

    from cluster.app import cpu_threads_per_replica
    from replica.engine import AsyncEngine, Engine

    model = resolve_model(args.model)
    config = ClusterConfig.model_validate(
        {
            "engine": {"model": str(model), "max_model_len": 1024, "num_kv_blocks": 256},
            "replicas": 1,
            "num_cpus_per_replica": 0.5,
        }
    )
    threads = cpu_threads_per_replica(config)
    torch.set_num_threads(threads)  # the replica sets the same count
    rng = random.Random(args.seed)
    n = args.num_requests + args.warmup
    cluster = LocalCluster()
    try:
        cluster.deploy(
            config.model_copy(
                update={"http": config.http.model_copy(update={"port": cluster.port})}
            )
        )
        specs = {
            # fresh prompts per mode: nothing is served from the prefix cache
            mode: [
                RequestSpec(
                    [rng.randrange(10, 500) for _ in range(args.input_len)], args.output_len
                )
                for _ in range(n)
            ]
            for mode in ("streaming", "non-streaming")
        }

        async def both_modes() -> dict:
            engine = AsyncEngine(Engine(config.engine))  # bound to this event loop
            try:
                return {
                    mode: await measure(
                        engine,
                        cluster.url,
                        config.model_name(),
                        specs[mode],
                        mode == "streaming",
                        args.warmup,
                    )
                    for mode in specs
                }
            finally:
                engine.shutdown()

        modes = asyncio.run(both_modes())
    finally:
        cluster.shutdown()

    print(
        f"{args.num_requests} request pairs per mode, prompt {args.input_len} tokens, "
        f"{args.output_len} output tokens, {threads} torch threads on both sides"
    )
    print(f"{'mode':<14} {'engine p50':>11} {'HTTP p50':>9} {'added p50':>10} {'added p99':>10}")
    for mode, m in modes.items():
        print(
            f"{mode:<14} {m['engine_e2e_ms']['median']:>11.2f} {m['http_e2e_ms']['median']:>9.2f} "
            f"{m['added_ms']['median']:>10.2f} {m['added_ms']['p99']:>10.2f}"
        )
    met = modes["streaming"]["added_ms"]["median"] < TARGET_MEDIAN_MS
    print(f"target: added median < {TARGET_MEDIAN_MS} ms (streaming): {'met' if met else 'MISSED'}")
    if args.quick:
        return
    result = {
        "benchmark": "http_overhead",
        "title": f"HTTP + routing overhead: 1 replica, prompt {args.input_len} / "
        f"{args.output_len} output tokens, requests one at a time",
        "model": args.model,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "torch_threads": threads,
        "target": f"added median < {TARGET_MEDIAN_MS} ms",
        "target_met": met,
        "host": machine_info(),
        "modes": modes,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "http_overhead.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    from bench.plots import plot_overhead

    png = plot_overhead(result, RESULTS / "http_overhead.png")
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
