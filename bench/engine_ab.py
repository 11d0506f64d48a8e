"""Engine-core A/B: the same arrivals into two engine cores that differ in EngineConfig
settings, alternated round by round.

Each arm (`--arm NAME:FIELD=VALUE[,FIELD=VALUE...]`, two of them; the default is the step
join on and off) is the replica's own front/core split (ProcessEngine: the engine core in its
own process, pinned as a serving replica's is, detokenized by its front), without HTTP or Ray,
so the only difference between the two is the settings. Both see the same long-tail prompts at
the same Poisson offsets in each (round, rate), so per-request times pair up. Per arm: TTFT as
a client counts it (the first output that carries text: a byte-level token that is part of a
character shows none), the first token's time, TPOT, and from the core's step trace the share
of requests that joined a step under way; per rate, the median of the paired per-request
differences of both TTFTs with bootstrap 95% intervals.

    .venv/bin/python bench/engine_ab.py --request-rate 1,2,3,4 --num-prompts 40 --rounds 3 \
        --out step_join_amd_s59      # arms join:step_join=true, nojoin:step_join=false
    .venv/bin/python bench/engine_ab.py --arm text:first_text_priority=true \
        --arm plain:first_text_priority=false --rounds 3 --out first_text_amd_s60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._models import model_dir  # noqa: E402
from sim.workloads import arrival_offsets, long_tail_dataset  # noqa: E402

DEFAULT_ARMS = ("join:step_join=true", "nojoin:step_join=false")


def parse_arm(spec: str) -> tuple[str, dict]:
    """'NAME:FIELD=VALUE,...' -> (NAME, {FIELD: VALUE}) with JSON values (true, 4, "x")."""
    name, _, settings = spec.partition(":")
    fields = {}
    for item in filter(None, settings.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--arm {spec!r}: {item!r} is not FIELD=VALUE")
        try:
            fields[key] = json.loads(value)
        except ValueError:
            fields[key] = value
    return name, fields


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def bootstrap_median(values: list[float], seed: int = 0, n: int = 2000) -> tuple[float, float]:
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return medians[int(0.025 * n)], medians[int(0.975 * n) - 1]


async def trial(engine, specs, offsets, tag: str) -> list[dict]:
    """Send every spec at its offset; per request: the first token's and the first text's
    time and the mean inter-token time (s)."""
    from replica.request import EngineRequest, SamplingParams

    start = time.monotonic() + 0.1

    async def one(i: int) -> dict:
        spec = specs[i]
        await asyncio.sleep(max(0.0, start + offsets[i] - time.monotonic()))
        params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
        request = EngineRequest(list(spec.prompt_ids), params, f"{tag}-{i}")
        sent, first, text, last, count, text_at = time.monotonic(), None, None, None, 0, 0
        async for out in engine.generate(request):
            if out.new_token_ids:
                last = time.monotonic()
                first = first if first is not None else last
                count += len(out.new_token_ids)
            if out.new_text and text is None:
                text, text_at = time.monotonic(), count
        tpot = (last - first) / (count - 1) if count > 1 else None
        text = last if text is None else text  # no text at all: counted at the end
        return {"id": request.request_id, "token": first - sent, "ttft": text - sent,
                "tpot": tpot, "text_at": text_at or count}  # fmt: skip

    return await asyncio.gather(*(one(i) for i in range(len(specs))))


def joined_ids(trace: Path, tag: str) -> set[str]:
    """Requests whose prompt's first chunk ran in a step that took it under way."""
    joined = set()
    for line in trace.read_text().splitlines():
        row = json.loads(line)
        if row.get("ev") != "step" or "join" not in row:
            continue
        for rid, start, *_ in row["reqs"]:
            if rid.startswith(tag) and start == 0:
                joined.add(rid)
    return joined


async def main_async(args) -> dict:
    from replica.config import EngineConfig
    from replica.engine.core_client import ProcessEngine
    from replica.engine.core_process import STEP_TRACE_ENV

    model = model_dir(args.model)
    rates = [float(r) for r in args.request_rate.split(",")]
    arms = dict(parse_arm(spec) for spec in args.arm or DEFAULT_ARMS)
    if len(arms) != 2:
        raise SystemExit(f"two arms with different names, not {list(arms)}")
    systems = tuple(arms)
    traces = {name: Path(tempfile.mkdtemp()) / f"{name}.jsonl" for name in systems}
    engines = {}
    for name in systems:  # each core writes its own step trace (read for the joins)
        os.environ[STEP_TRACE_ENV] = str(traces[name])
        config = EngineConfig(model=str(model), dtype=args.dtype, device="cpu", **arms[name])
        engines[name] = ProcessEngine(config)
    os.environ.pop(STEP_TRACE_ENV, None)
    rows, held = [], []
    try:
        warm = long_tail_dataset(args.warmup_prompts, 64, 16, 32, 1.0, random.Random(99))
        for name in systems:
            await trial(engines[name], warm, [0.0] * len(warm), f"warm-{name}")
        for r in range(args.rounds):
            for k, rate in enumerate(rates):
                seed = args.seed + 1000 * r + k
                rng = random.Random(seed)
                specs = long_tail_dataset(
                    args.num_prompts, args.input_len, args.output_median, args.output_max,
                    1.0, rng,
                )  # fmt: skip
                offsets = arrival_offsets(len(specs), rate, 1.0, rng)
                order = systems if (r + k) % 2 == 0 else systems[::-1]
                for name in order:
                    await asyncio.sleep(args.settle_s)
                    tag = f"{name}-r{r}-{rate:g}"
                    holds = getattr(engines[name]._stats, "num_first_text_holds_total", 0)
                    results = await trial(engines[name], specs, offsets, tag)
                    await asyncio.sleep(0.2)  # the core's idle report: its latest totals
                    holds = getattr(engines[name]._stats, "num_first_text_holds_total", 0) - holds
                    joined = joined_ids(traces[name], tag)
                    for i, res in enumerate(results):
                        rows.append({"system": name, "round": r, "rate": rate, "index": i,
                                     "ttft": res["ttft"], "token": res["token"],
                                     "tpot": res["tpot"], "text_at": res["text_at"],
                                     "joined": res["id"] in joined})  # fmt: skip
                    held.append({"system": name, "round": r, "rate": rate, "holds": holds})
                    ttfts = [res["ttft"] * 1e3 for res in results]
                    later = sum(res["text_at"] > 1 for res in results)
                    print(f"round {r + 1} {name:7s} @ {rate:g} req/s: TTFT p50 "
                          f"{statistics.median(ttfts):6.1f} ms, joined {len(joined)}/{len(results)}, "
                          f"first text after token 1: {later}, holds {holds}", flush=True)  # fmt: skip
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {"rates": rates, "arms": arms, "systems": list(systems), "rows": rows, "holds": held}


def summarize(data: dict) -> list[dict]:
    rows, summary = data["rows"], []
    a, b = data["systems"]
    for rate in data["rates"]:
        by = {
            name: {
                (x["round"], x["index"]): x
                for x in rows
                if x["system"] == name and x["rate"] == rate
            }
            for name in (a, b)
        }
        entry = {"rate": rate}
        for name in (a, b):
            ttft = [x["ttft"] * 1e3 for x in by[name].values()]
            token = [x["token"] * 1e3 for x in by[name].values()]
            tpot = [x["tpot"] * 1e3 for x in by[name].values() if x["tpot"] is not None]
            entry[name] = {
                "ttft_p50": statistics.median(ttft), "ttft_p90": percentile(ttft, 90),
                "ttft_p99": percentile(ttft, 99), "token_p50": statistics.median(token),
                "token_p99": percentile(token, 99), "tpot_p50": statistics.median(tpot),
                "joined": sum(x["joined"] for x in by[name].values()) / len(ttft),
            }  # fmt: skip
        for key in ("ttft", "token"):
            diffs = [(by[a][k][key] - by[b][k][key]) * 1e3 for k in by[a]]
            entry[f"paired_{key}_diff_p50"] = statistics.median(diffs)
            entry[f"paired_{key}_diff_ci"] = bootstrap_median(diffs)
        summary.append(entry)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--request-rate", default="1,2,3,4")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens, mean (+-50%%)")
    p.add_argument("--output-median", type=int, default=32)
    p.add_argument("--output-max", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-prompts", type=int, default=8)
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arm",
        action="append",
        metavar="NAME:FIELD=VALUE,...",
        help="an arm: EngineConfig fields (JSON values); give two (default: "
        + " and ".join(DEFAULT_ARMS)
        + ")",
    )
    p.add_argument("--out", help="NAME: bench/results/NAME.json")
    args = p.parse_args()
    data = asyncio.run(main_async(args))
    data["summary"] = summarize(data)
    data["args"] = vars(args)
    a, b = data["systems"]
    print(f"\n{'req/s':>5} {'arm':8s} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'token p50':>9} "
          f"{'p99':>7} {'TPOT p50':>9} joined")  # fmt: skip
    for entry in data["summary"]:
        for name in (a, b):
            s = entry[name]
            print(f"{entry['rate']:5g} {name:8s} {s['ttft_p50']:9.1f} {s['ttft_p90']:7.1f} "
                  f"{s['ttft_p99']:7.1f} {s['token_p50']:9.1f} {s['token_p99']:7.1f} "
                  f"{s['tpot_p50']:9.1f} {s['joined']:6.0%}")  # fmt: skip
        for key, label in (("ttft", "TTFT (text)"), ("token", "first token")):
            lo, hi = entry[f"paired_{key}_diff_ci"]
            print(f"{'':5s} {a} - {b}, {label}, paired per request: median "
                  f"{entry[f'paired_{key}_diff_p50']:+.1f} ms [{lo:+.1f}, {hi:+.1f}]")  # fmt: skip
    if args.out:
        out = Path(__file__).resolve().parent / "results" / f"{args.out}.json"
        out.write_text(json.dumps(data, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
