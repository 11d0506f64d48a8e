"""What the HTTP + routing path adds per request over calling the engine directly, side by side
in one run: the same requests (token-id prompts, `ignore_eos`, greedy) go one at a time, in
rotating order, to (a) an in-process AsyncEngine, (b) a 1-replica stepserve cluster over HTTP
(HAProxy or Serve proxy -> ingress -> LoadAwareRouter -> replica -> SSE back), built from the same
EngineConfig and torch thread count, and (c) that replica through a deployment handle from
this process (router + actor + Ray streaming, no proxy or ingress), which splits (b)'s cost,
and (d) Ray Serve's own floor: an application of the same shape on the same cluster (FastAPI
ingress -> deployment handle -> a replica that does no work and streams as many SSE events as
(b) sends, or answers in one unary call), so what Ray Serve costs by itself is told apart from
what stepserve adds. Reports per-request e2e and TTFT and their paired differences (median,
p99), streaming and non-streaming. Writes bench/results/http_overhead.json + .png.

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
import uuid
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


def floor_app():
    """The Ray Serve floor: the same path shape as stepserve's (proxy -> FastAPI ingress ->
    deployment handle -> replica -> SSE back) with no validation, tokenizer or engine. The
    replica streams `max_tokens` one-token items (streaming) or returns them in one call."""
    from fastapi import Body, FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from ray import serve

    app = FastAPI()

    @serve.deployment(name="FloorReplica", ray_actor_options={"num_cpus": 0})
    class FloorReplica:
        async def generate(self, n: int):
            for i in range(n):
                yield {"token": i}

        async def generate_all(self, n: int) -> dict:
            return {"tokens": list(range(n))}

    @serve.deployment(name="FloorIngress", ray_actor_options={"num_cpus": 0})
    @serve.ingress(app)
    class FloorIngress:
        def __init__(self, replica) -> None:
            self.replica = replica
            self.stream_replica = replica.options(stream=True)

        @app.post("/v1/completions")
        async def completions(self, body: dict = Body(...)):  # noqa: B008
            n = int(body["max_tokens"])
            if not body.get("stream"):
                out = await self.replica.generate_all.remote(n)
                return JSONResponse({"choices": [{"text": "x" * len(out["tokens"])}]})

            async def events():
                async for item in self.stream_replica.generate.remote(n):
                    yield f"data: {json.dumps({'choices': [{'text': str(item['token'])}]})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

    return FloorIngress.bind(FloorReplica.bind())


async def engine_request(engine, spec: RequestSpec) -> tuple[float, float]:
    """(e2e, ttft) in seconds of one request on the in-process AsyncEngine."""

    from replica.request import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    request = EngineRequest(spec.prompt_ids, params, uuid.uuid4().hex)
    start = time.perf_counter()
    ttft = None
    async for out in engine.generate(request):
        if ttft is None and getattr(out, "new_token_ids", None):  # not an Accepted
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


async def handle_request(handle, spec: RequestSpec) -> tuple[float, float]:
    """(e2e, ttft) through a deployment handle from this process: the same router and replica
    actor as the HTTP path, without the HTTP proxy and the ingress."""
    from replica.contracts import GenerateRequest
    from replica.request import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    request = EngineRequest(spec.prompt_ids, params, uuid.uuid4().hex)
    request = GenerateRequest(spec.prompt_ids, params, uuid.uuid4().hex)
    start = time.perf_counter()
    ttft = None
    async for out in handle.generate.remote(request):
        if ttft is None and getattr(out, "new_token_ids", None):  # not an Accepted
            ttft = time.perf_counter() - start
    return time.perf_counter() - start, ttft or 0.0


async def measure(
    engine, handle, base_url: str, floor_url: str, model: str, specs, stream: bool, warmup: int
) -> dict:
    """Each request four ways, one at a time; the order rotates so that drift and cache
    effects hit every path alike."""
    url = base_url + "/v1/completions"
    floor = floor_url + "/v1/completions"
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        paths = {
            "engine": lambda spec: engine_request(engine, spec),
            "handle": lambda spec: handle_request(handle, spec),
            "http": lambda spec: http_request(session, url, model, spec, stream),
            "floor": lambda spec: http_request(session, floor, model, spec, stream),
        }
        names = list(paths)
        for i, spec in enumerate(specs):
            k = i % len(names)
            order = names[k:] + names[:k]
            row = {name: await paths[name](spec) for name in order}
            if i >= warmup:
                rows.append(row)

    def e2e(name: str) -> list[float]:
        return [row[name][0] for row in rows]

    def added(name: str, over: str = "engine", index: int = 0) -> list[float]:
        return [row[name][index] - row[over][index] for row in rows]

    out = {
        "pairs": len(rows),
        "engine_e2e_ms": describe_ms(e2e("engine")),
        "handle_e2e_ms": describe_ms(e2e("handle")),
        "http_e2e_ms": describe_ms(e2e("http")),
        "serve_floor_e2e_ms": describe_ms(e2e("floor")),
        "added_ms": describe_ms(added("http")),
        # what stepserve's HTTP path costs beyond Ray Serve's floor for the same shape
        "added_over_serve_floor_ms": describe_ms(
            [row["http"][0] - row["engine"][0] - row["floor"][0] for row in rows]
        ),
        "added_by_handle_ms": describe_ms(added("handle")),
        "added_by_http_over_handle_ms": describe_ms(added("http", over="handle")),
        "difference_of_medians_ms": round(
            1000 * (statistics.median(e2e("http")) - statistics.median(e2e("engine"))), 3
        ),
        "engine_e2e_s": [round(x, 6) for x in e2e("engine")],
        "http_e2e_s": [round(x, 6) for x in e2e("http")],
        "floor_e2e_s": [round(x, 6) for x in e2e("floor")],
    }
    if stream:
        out["engine_ttft_ms"] = describe_ms([row["engine"][1] for row in rows])
        out["http_ttft_ms"] = describe_ms([row["http"][1] for row in rows])
        out["added_ttft_ms"] = describe_ms(added("http", index=1))
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
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the replica and the in-process engine (default: the cluster's "
        "own choice, cores // replicas)",
    )
    p.add_argument(
        "--engine-core",
        choices=["process", "thread"],
        default="process",
        help="the replica's engine core: a process of its own (default) or a thread of the "
        "actor (the in-process engine of (a) is a thread either way)",
    )
    p.add_argument("--out", default=None, help="JSON path (PNG beside it)")
    args = p.parse_args()
    if args.quick:
        args.num_requests = 30
    import torch
    from ray import serve

    from cluster.app import thread_settings
    from replica.deployment import resolve_cpu_threads
    from replica.engine import AsyncEngine, Engine

    model = resolve_model(args.model)
    config = ClusterConfig.model_validate(
        {
            "engine": {
                "model": str(model),
                "max_model_len": 1024,
                "num_kv_blocks": 256,
                "engine_core": args.engine_core,
            },
            "replicas": 1,
            "num_cpus_per_replica": 0.5,
            "cpu_threads_per_replica": args.threads,
        }
    )
    threads = resolve_cpu_threads(thread_settings(config))
    torch.set_num_threads(threads)  # the replica sets the same count
    rng = random.Random(args.seed)
    n = args.num_requests + args.warmup
    cluster = LocalCluster()
    try:
        base_url = cluster.deploy(config, "overhead")
        serve.run(floor_app(), name="floor", route_prefix="/floor")  # returns once running
        floor_url = f"{cluster.url}/floor"
        # mode: (SSE streaming?, output tokens); fresh prompts per mode, so nothing is
        # served from the prefix cache. One output token shows the fixed per-request cost.
        plan = {
            "streaming": (True, args.output_len),
            "non-streaming": (False, args.output_len),
            "streaming, 1 token": (True, 1),
        }
        specs = {
            mode: [
                RequestSpec([rng.randrange(10, 500) for _ in range(args.input_len)], out_len)
                for _ in range(n)
            ]
            for mode, (_, out_len) in plan.items()
        }

        async def both_modes() -> dict:
            engine = AsyncEngine(Engine(config.engine))  # bound to this event loop
            handle = serve.get_deployment_handle("LLMServer", app_name="overhead")
            handle = handle.options(stream=True)
            try:
                return {
                    mode: await measure(
                        engine,
                        handle,
                        base_url,
                        floor_url,
                        config.model_name(),
                        specs[mode],
                        plan[mode][0],
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
        f"{args.output_len} output tokens (1 in the last mode), {threads} torch threads on "
        "every path"
    )
    print(
        f"{'mode':<20} {'engine p50':>11} {'handle p50':>11} {'HTTP p50':>9} {'added p50':>10} "
        f"{'added p99':>10} {'by handle':>10} {'HTTP-handle':>12} {'Serve floor':>12} "
        f"{'over floor':>11}"
    )
    for mode, m in modes.items():
        print(
            f"{mode:<20} {m['engine_e2e_ms']['median']:>11.2f} "
            f"{m['handle_e2e_ms']['median']:>11.2f} {m['http_e2e_ms']['median']:>9.2f} "
            f"{m['added_ms']['median']:>10.2f} {m['added_ms']['p99']:>10.2f} "
            f"{m['added_by_handle_ms']['median']:>10.2f} "
            f"{m['added_by_http_over_handle_ms']['median']:>12.2f} "
            f"{m['serve_floor_e2e_ms']['median']:>12.2f} "
            f"{m['added_over_serve_floor_ms']['median']:>11.2f}"
        )
    met = modes["streaming"]["added_ms"]["median"] < TARGET_MEDIAN_MS
    print(f"target: added median < {TARGET_MEDIAN_MS} ms (streaming): {'met' if met else 'MISSED'}")
    floors = {mode: m["serve_floor_e2e_ms"]["median"] for mode, m in modes.items()}
    print(
        "Ray Serve's own floor for the same path shape (no stepserve code, no engine), median ms: "
        + ", ".join(f"{mode} {v:.2f}" for mode, v in floors.items())
    )
    if args.quick:
        return
    result = {
        "benchmark": "http_overhead",
        "title": f"HTTP + routing overhead: 1 replica, {args.input_len}-token prompts, "
        f"{args.output_len} output tokens (1 in the last panel), requests one at a time",
        "model": args.model,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "torch_threads": threads,
        "engine_core": args.engine_core,
        "target": f"added median < {TARGET_MEDIAN_MS} ms",
        "target_met": met,
        "serve_floor_note": "serve_floor_e2e_ms: a no-op application of the same shape on the "
        "same cluster (FastAPI ingress -> handle -> replica streaming as many items); "
        "added_over_serve_floor_ms = HTTP - engine - floor, per request",
        "host": machine_info(),
        "modes": modes,
    }
    path = Path(args.out) if args.out else RESULTS / "http_overhead.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    from bench.plots import plot_overhead

    png = plot_overhead(result, path.with_suffix(".png"))
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
