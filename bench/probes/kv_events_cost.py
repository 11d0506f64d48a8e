"""What KV events cost per engine step: the same scheduler workload (multi-turn chats through a
small KV cache, so blocks are stored and evicted every step; a fake runner, no model) with
events off and on, rounds alternating. Reports per step: scheduler time (schedule +
update_from_output, plus sealing the batch when on), events, the batch's pickled size (what
crosses to the hub), and the time the hub (KVEventHub.publish) and a router's index
(KVIndex.apply) spend on it. Writes bench/results/kv_events_cost.json.

Run: .venv/bin/python bench/probes/kv_events_cost.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from replica.config import EngineConfig  # noqa: E402
from replica.kv_events import KVEventHub  # noqa: E402
from replica.request import EngineRequest, Request, SamplingParams  # noqa: E402
from replica.scheduler import Scheduler  # noqa: E402
from router.kv_index import KVIndex  # noqa: E402
from sim.workloads import multi_turn_conversations  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results" / "kv_events_cost.json"


def run(events: bool, steps: int, seed: int) -> dict:
    cfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, block_size=16)
    sched = Scheduler(cfg, 1500, 4096)
    log = sched.kv.pool.enable_events(16) if events else None
    hub, index = KVEventHub(), KVIndex(16)
    rng = random.Random(seed)
    convs = multi_turn_conversations(400, 40.0, rng, system_len=512, user_len=48,
                                     output_len=48, turns=(3, 8), think_s=0.0)  # fmt: skip
    pending = [(c, 0) for c in convs]
    step_s, seal_s, sizes, counts, hub_s, index_s = [], [], [], [], [], []
    n = 0
    active: dict[str, tuple] = {}
    gc.disable()
    for _ in range(steps):
        while pending and len(active) < 96:
            conv, k = pending.pop(0)
            rid = f"c{conv.conversation_id}-{k}"
            params = SamplingParams(max_tokens=conv.turns[k].output_len, ignore_eos=True)
            sched.add_request(Request(EngineRequest(conv.prompt(k), params, rid)))
            active[rid] = (conv, k)
        t0 = time.perf_counter()
        so = sched.schedule()
        outs = sched.update_from_output(so, {s.request_id: 7 for s in so.scheduled if s.sample})
        t1 = time.perf_counter()
        batch = log.seal() if log is not None else None
        t2 = time.perf_counter()
        step_s.append(t1 - t0)
        if log is not None:
            seal_s.append(t2 - t1)
            if batch is not None:
                counts.append(len(batch.events))
                sizes.append(len(pickle.dumps(batch)))
                t3 = time.perf_counter()
                hub.publish("r0", [batch])
                t4 = time.perf_counter()
                index.apply("r0", batch)
                t5 = time.perf_counter()
                hub_s.append(t4 - t3)
                index_s.append(t5 - t4)
        for out in outs:
            if out.finish_reason is not None:
                conv, k = active.pop(out.request_id)
                if k + 1 < len(conv.turns):
                    pending.append((conv, k + 1))
        n += 1
    gc.enable()
    out = {"steps": n, "step_us_median": statistics.median(step_s) * 1e6}
    if log is not None:
        out.update(
            seal_us_median=statistics.median(seal_s) * 1e6,
            events_per_step_mean=sum(counts) / n,
            events_per_batch_median=statistics.median(counts) if counts else 0,
            batch_bytes_median=statistics.median(sizes) if sizes else 0,
            hub_publish_us_median=statistics.median(hub_s) * 1e6 if hub_s else 0,
            index_apply_us_median=statistics.median(index_s) * 1e6 if index_s else 0,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.steps, args.rounds = 500, 2
    rows = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            rows[mode].append(run(mode == "on", args.steps, seed=r))
    off = statistics.median(x["step_us_median"] for x in rows["off"])
    on = statistics.median(x["step_us_median"] for x in rows["on"])
    seal = statistics.median(x["seal_us_median"] for x in rows["on"])
    summary = {
        "scheduler_step_us_off": off,
        "scheduler_step_us_on": on,
        "seal_us": seal,
        "overhead_us_per_step": on + seal - off,
        "overhead_ratio": (on + seal) / off,
        "events_per_step": statistics.median(x["events_per_step_mean"] for x in rows["on"]),
        "batch_bytes": statistics.median(x["batch_bytes_median"] for x in rows["on"]),
        "hub_publish_us": statistics.median(x["hub_publish_us_median"] for x in rows["on"]),
        "index_apply_us": statistics.median(x["index_apply_us_median"] for x in rows["on"]),
    }
    for k, v in summary.items():
        print(f"{k:28s} {v:10.2f}")
    if not args.quick:
        RESULTS.write_text(json.dumps({"summary": summary, "rounds": rows}, indent=1) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
