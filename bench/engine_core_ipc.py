"""Per-step cost of the engine core's IPC (replica/engine/wire.py): a child process plays the
core, sending decode steps of B requests (one new token each: a wire.Step of B RequestOutputs
and a StepReport, encoded by the core's codec over a Unix socket pair, exactly the core's
message), and this process plays the front (receive + decode into typed outputs). Reports, per step and batch size, the core's CPU time to
encode and send, the front's to receive and decode, and the bytes on the wire, beside a
measured decode step of the default model at that batch (the cost as a share of the step).

Run: .venv/bin/python bench/engine_core_ipc.py [--steps 2000] [--out bench/results/engine_core_ipc.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replica.engine import wire  # noqa: E402
from replica.request import RequestOutput  # noqa: E402
from replica.scheduler import SchedulerStats  # noqa: E402


def step_message(batch: int, step: int) -> wire.Step:
    outputs = [
        RequestOutput(f"req-{i:08x}", [1000 + (step + i) % 40000], "", 120, step + 1)
        for i in range(batch)
    ]
    report = wire.StepReport(
        time.monotonic(), 0.03, batch, [], [], SchedulerStats(batch, 0, 0.4, 0, 0, 0)
    )
    return wire.Step(outputs, report, 100, batch)


def core_side(fd: int, batch: int, steps: int, result) -> None:
    conn = Connection(fd)
    encode = wire.core_codec().encode
    cpu = []
    for step in range(steps):
        message = step_message(batch, step)  # made by the engine step, not counted
        t0 = time.thread_time()
        conn.send_bytes(encode(message))
        cpu.append(time.thread_time() - t0)
    conn.send_bytes(encode(wire.Dead("done")))
    result.put(statistics.median(cpu))


def measure(batch: int, steps: int) -> dict:
    front, core = socket.socketpair()
    result = mp.get_context("fork").Queue()
    proc = mp.get_context("fork").Process(
        target=core_side, args=(core.detach(), batch, steps, result)
    )
    proc.start()
    conn = Connection(front.detach())
    decode = wire.front_codec().decode
    cpu = []
    while True:
        t0 = time.thread_time()
        message = decode(conn.recv_bytes())
        if isinstance(message, wire.Dead):
            break
        cpu.append(time.thread_time() - t0)
        assert len(message.outputs) == batch
    proc.join()
    size = len(wire.core_codec().encode(step_message(batch, 0)))
    return {
        "batch": batch,
        "core_encode_send_us": round(result.get() * 1e6, 1),
        "front_recv_decode_us": round(statistics.median(cpu) * 1e6, 1),
        "bytes": size,
    }


def decode_step_ms(batches: list[int]) -> dict[int, float]:
    """Median decode step of the default model at each batch (fp32, this host's threads)."""
    from replica.engine import Engine, EngineConfig
    from replica.request import SamplingParams

    engine = Engine(EngineConfig(max_model_len=512, num_kv_blocks=512))
    times: dict[int, float] = {}
    for batch in batches:
        for i in range(batch):
            engine.add_request(
                f"b{batch}-{i}", [100 + i, 200, 300, 400], SamplingParams(max_tokens=40,
                                                                         ignore_eos=True)
            )  # fmt: skip
        steps = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        times[batch] = statistics.median(steps[5:]) * 1e3
    engine.shutdown()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--no-model", action="store_true", help="skip the decode-step timing")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = [measure(b, args.steps) for b in batches]
    if not args.no_model:
        step_ms = decode_step_ms(batches)
        for row in rows:
            row["decode_step_ms"] = round(step_ms[row["batch"]], 2)
            ipc_ms = (row["core_encode_send_us"] + row["front_recv_decode_us"]) / 1e3
            row["ipc_share_of_step"] = round(ipc_ms / step_ms[row["batch"]], 4)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
