"""The engine core in a process of its own (replica/engine/core_process.py): the same streams as the
in-thread engine (tokens, text, stop strings, logprobs, grammars), aborts and stop strings that
free the core's blocks, errors that name the request's problem, and lifetimes tied both ways
(the core's death ends every stream and fails the health check; the front's death, even by
SIGKILL, ends the core)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from replica.config import EngineConfig
from replica.contracts import GenerateRequest
from replica.engine import AsyncEngine, Engine, wire
from replica.engine.core_client import ProcessEngine
from replica.kv_events import KVEventBatch
from replica.request import (
    EngineDeadError,
    EngineRequest,
    GrammarRejected,
    RequestOutput,
    RequestRejected,
    SamplingParams,
    StructuredOutput,
)
from replica.scheduler import SchedulerStats
from tests.helpers import engine_request
from tests.replica.test_model_parity import mixed_prompts


def config(model_dir, **fields) -> EngineConfig:
    fields = {"device": "cpu", "block_size": 4, "num_kv_blocks": 256, "max_model_len": 256,
              **fields}  # fmt: skip
    return EngineConfig(model=str(model_dir), **fields)


async def collect(stream) -> RequestOutput:
    merged = None
    async for out in stream:
        merged = out if merged is None else merged.merge(out)
    return merged


async def run_all(engine, jobs) -> list[RequestOutput]:
    return await asyncio.gather(
        *(collect(engine.generate(engine_request(ids, params, request_id=f"r{i}"))) for i, (ids, params) in
          enumerate(jobs))
    )  # fmt: skip


def in_loop(body, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(body(), timeout))


async def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_wire_format_round_trips_every_field():
    out = RequestOutput("r", [1, 2], "", 5, 2, "stop", 7, [(-0.1, {1: -0.1})], 3, 1, [(0.0, {})])
    stats = SchedulerStats(1, 2, 0.5, 3, 4, 5, 6, 7, 8)
    report = wire.StepReport(1.5, 0.25, 9, [("r", 1.0)], ["q"], stats, KVEventBatch(4, ((1, 2),)))
    step = wire.Step([out], report, 10, 2)
    assert wire.front_codec().decode(wire.core_codec().encode(step)) == step
    request = GenerateRequest(
        [1, 2, 3],
        SamplingParams(max_tokens=4, stop=["x"], logit_bias={7: 1.5},
                       structured=StructuredOutput("regex", "a+")),
        "r", priority=2, arrival_time=3.5, prefix_key=11,
    )  # fmt: skip
    back = wire.core_codec().decode(wire.front_codec().encode(wire.Add(request)))
    assert back.request == EngineRequest([1, 2, 3], request.sampling, "r", 2, 3.5)
    error = wire.Pickled.of(RequestRejected("no"))
    reply = wire.front_codec().decode(wire.core_codec().encode(wire.RequestError("r", error)))
    assert isinstance(reply.error.load(), RequestRejected)


def test_streams_match_the_in_thread_engine(tiny_llama_dir):
    """Greedy and seeded requests, logprobs, a stop string, and a JSON grammar: the process
    engine's merged streams equal the in-thread engine's, token for token and in text."""
    prompts = mixed_prompts(5, [3, 9, 17, 30, 6, 12])
    jobs = [
        (prompts[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
        (prompts[1], SamplingParams(temperature=0.8, seed=3, max_tokens=20, logprobs=2)),
        (prompts[2], SamplingParams(temperature=0.0, max_tokens=16, prompt_logprobs=1)),
        (prompts[3], SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)),
        (prompts[4], SamplingParams(temperature=1.0, seed=9, max_tokens=40,
                                    structured=StructuredOutput("json_object"))),
    ]  # fmt: skip

    async def thread_mode():
        engine = AsyncEngine(Engine(config(tiny_llama_dir, engine_core="thread")))
        try:
            return await run_all(engine, jobs)
        finally:
            engine.shutdown()

    expected = in_loop(thread_mode)
    # a stop string from the middle of the first answer's text
    text = expected[0].new_text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    stop_job = (prompts[0], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                           ignore_eos=True))  # fmt: skip
    jobs.append(stop_job)

    async def process_mode():
        engine = ProcessEngine(config(tiny_llama_dir))
        try:
            outs = await run_all(engine, jobs)
            # the stop string ended the request in the core too: nothing left there
            await wait_until(lambda: engine.num_request_states == 0)
            assert engine.num_free_blocks == engine.info.num_kv_blocks
            assert len(engine.processor) == 0
            return outs
        finally:
            engine.shutdown()

    got = in_loop(process_mode)
    for want, have in zip(expected, got[:-1], strict=True):
        assert have.new_token_ids == want.new_token_ids
        assert have.new_text == want.new_text
        assert have.finish_reason == want.finish_reason
        assert have.new_logprobs == want.new_logprobs
        assert have.prompt_logprobs == want.prompt_logprobs
    json.loads(got[4].new_text)  # the grammar held (it ends on EOS within 40 tokens or not)
    stopped = got[-1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.new_text == text[: text.index(stop)]


def test_the_front_is_ready_before_its_tokenizer_and_its_first_request_waits(
    tiny_llama_dir, monkeypatch
):
    """The front's tokenizer loads in a thread: the front is ready without it, and a request
    that comes before it has loaded waits for it, then streams the same text as later ones."""
    import threading

    import replica.tokenizer

    release = threading.Event()
    real_load = replica.tokenizer.load_tokenizer

    def held_load(model_dir):
        assert release.wait(60)
        return real_load(model_dir)

    monkeypatch.setattr(replica.tokenizer, "load_tokenizer", held_load)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = mixed_prompts(1, [9])[0]

    async def body():
        engine = ProcessEngine(config(tiny_llama_dir))  # returns with the load still held
        try:
            assert not engine._tokenizer.loaded
            first = asyncio.ensure_future(collect(engine.generate(engine_request(prompt, params))))
            await asyncio.sleep(0.5)
            assert not first.done() and len(engine.processor) == 0  # waiting, not submitted
            release.set()
            early = await first
            later = await collect(engine.generate(engine_request(prompt, params)))
            assert engine._tokenizer.loaded
            return early, later
        finally:
            release.set()
            engine.shutdown()

    early, later = in_loop(body)
    assert early.new_token_ids == later.new_token_ids and len(early.new_token_ids) == 8
    assert early.new_text == later.new_text and early.new_text


def test_abort_errors_and_calls_cross_the_process(tiny_llama_dir):
    async def body():
        engine = ProcessEngine(config(tiny_llama_dir, num_kv_blocks=40))
        try:
            # a request too large for the cache is refused in the front, naming the limit
            with pytest.raises(RequestRejected, match="whole KV cache has 40 blocks"):
                await collect(
                    engine.generate(engine_request([1] * 200, SamplingParams(max_tokens=100)))
                )
            # a grammar the core cannot compile: its error reaches the stream
            bad = SamplingParams(max_tokens=5, structured=StructuredOutput("regex", "(unclosed"))
            with pytest.raises(GrammarRejected, match="cannot compile the regex"):
                await collect(engine.generate(engine_request([1, 2, 3], bad)))
            # leaving a stream early aborts the request in the core and frees its blocks
            stream = engine.generate(
                engine_request([5, 6, 7], SamplingParams(max_tokens=120, ignore_eos=True))
            )
            first = await stream.__anext__()
            assert first.new_token_ids
            await stream.aclose()
            await wait_until(lambda: engine.num_request_states == 0)
            await wait_until(lambda: engine.num_free_blocks == 40)
            # thread count and a stall, applied in the core between steps
            engine.set_num_threads(1)
            await wait_until(lambda: engine.num_threads == 1)
            assert engine.call("kv_stats").result(10) == {}
            with pytest.raises(ValueError, match="unknown engine core call"):
                engine.call("nope").result(10)
            engine.check_health()
        finally:
            engine.shutdown()
        assert engine._proc.poll() is not None

    in_loop(body)


def test_the_step_trace_records_each_add_and_step(tiny_llama_dir, tmp_path, monkeypatch):
    """STEPSERVE_STEP_TRACE: the core appends a line per request it is handed and per step,
    on the monotonic clock the front's arrival times use (bench/ttft_decompose.py lines the
    client's send times up with them)."""
    from replica.engine.core_process import STEP_TRACE_ENV

    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(STEP_TRACE_ENV, str(trace))

    async def body():
        engine = ProcessEngine(config(tiny_llama_dir, num_speculative_tokens=0))
        try:
            before = time.monotonic()
            out = await collect(
                engine.generate(engine_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True),
                                request_id="traced"))
            )  # fmt: skip
            assert out.num_output_tokens == 3
            pid = engine._proc.pid
        finally:
            engine.shutdown()
        return before, time.monotonic(), pid

    before, after, engine_pid = in_loop(body)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    (add,) = [line for line in lines if line["ev"] == "add"]
    assert add["rid"] == "traced" and before <= add["arrival"] <= add["t"] <= after
    steps = [line for line in lines if line["ev"] == "step"]
    # every line names the core process that wrote it (the replicas of a server share a file)
    assert {line["pid"] for line in lines} == {engine_pid}
    rows = [row for step in steps for row in step["reqs"] if row[0] == "traced"]
    # the prompt in one step (5 tokens from position 0), then one token per step (drafts
    # off), every row naming the prompt's length
    assert rows[0][1:] == [0, 5, 0, 5]
    assert [row[1] for row in rows] == [0, 5, 6]
    assert all(row[4] == 5 for row in rows)
    for step in steps:
        assert add["t"] < step["t"] <= after and 0 < step["forward"] <= step["dur"]


def test_a_step_trace_that_cannot_be_written_leaves_the_core_serving(
    tiny_llama_dir, tmp_path, monkeypatch
):
    from replica.engine.core_process import STEP_TRACE_ENV

    monkeypatch.setenv(STEP_TRACE_ENV, str(tmp_path / "no-such-dir" / "trace.jsonl"))

    async def body():
        engine = ProcessEngine(config(tiny_llama_dir))
        try:
            out = await collect(
                engine.generate(engine_request([5, 6, 7], SamplingParams(max_tokens=2)))
            )
            assert out.num_output_tokens == 2
        finally:
            engine.shutdown()

    in_loop(body)
    assert not (tmp_path / "no-such-dir").exists()


def test_an_idle_core_loads_the_grammar_engine_before_a_constrained_request(tiny_llama_dir):
    """The core imports xgrammar and builds its compiler once it has been idle for a
    heartbeat, so the first constrained request does not pause the requests running beside
    it with that work."""

    async def body():
        engine = ProcessEngine(config(tiny_llama_dir))
        try:
            deadline = time.monotonic() + 30
            while not engine.call("grammar_compiler_ready").result(10):
                assert time.monotonic() < deadline, "the idle core never loaded xgrammar"
                await asyncio.sleep(0.2)
        finally:
            engine.shutdown()

    in_loop(body)


def test_core_death_ends_streams_and_fails_health(tiny_llama_dir):
    async def body():
        engine = ProcessEngine(config(tiny_llama_dir))
        try:
            stream = engine.generate(
                engine_request([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))
            )
            await stream.__anext__()
            os.kill(engine.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match=f"process {engine.pid} exited with code -9"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                engine.check_health()
            with pytest.raises(EngineDeadError):  # and new requests are refused
                await collect(engine.generate(engine_request([1, 2], SamplingParams(max_tokens=2))))
        finally:
            engine.shutdown()

    in_loop(body)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_core_exits_when_its_front_is_killed(tiny_llama_dir, tmp_path):
    """The front SIGKILLed (as Ray kills a replica's actor), mid-stream and idle: its core
    process goes within seconds."""
    script = textwrap.dedent(f"""
        import asyncio, os, sys
        from replica.config import EngineConfig
        from replica.engine.core_client import ProcessEngine
        from replica.request import SamplingParams
        from tests.helpers import engine_request

        async def main():
            engine = ProcessEngine(EngineConfig(model={str(tiny_llama_dir)!r}, device="cpu",
                                                block_size=4, num_kv_blocks=256))
            stream = engine.generate(engine_request([5, 6, 7], SamplingParams(max_tokens=100000 // 400,
                                                               ignore_eos=True)))
            await stream.__anext__()
            print(engine.pid, flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
    """)
    front = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    core_pid = int(front.stdout.readline())
    front.kill()
    front.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not alive(core_pid):
            return
        time.sleep(0.1)
    os.kill(core_pid, signal.SIGKILL)
    raise AssertionError(f"engine core {core_pid} outlived its front by 20 s")


# -- a core started before its replica (PrestartedCore, `stepserve serve`) -------------------
@pytest.fixture
def prestarted(tiny_llama_dir, monkeypatch):
    """Start a pre-started core for the tiny model and point this process's fronts at it."""
    from replica.engine.prestart import PRESTARTED_CORE_ENV, PrestartedCore

    cores = []

    def start(cfg: EngineConfig) -> PrestartedCore:
        core = PrestartedCore(cfg, num_threads=1)
        cores.append(core)
        monkeypatch.setenv(PRESTARTED_CORE_ENV, core.path)
        return core

    yield start
    for core in cores:
        core.close(timeout=10)


def test_a_prestarted_core_is_adopted_once_and_streams_as_a_spawned_one(tiny_llama_dir, prestarted):
    core = prestarted(config(tiny_llama_dir))
    # greedy and seeded: an unseeded draw depends on which requests share a step, which
    # depends on timing
    jobs = [
        (ids, SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=12,
                             ignore_eos=True))
        for i, ids in enumerate(mixed_prompts(7, [3, 9, 17, 6]))
    ]  # fmt: skip

    async def body():
        adopted = ProcessEngine(config(tiny_llama_dir), num_threads=2)
        spawned = ProcessEngine(config(tiny_llama_dir))  # the socket is gone: its own core
        try:
            assert adopted.pid == core.proc.pid
            assert "core_adopted" in adopted.info.startup_s
            assert spawned.pid != core.proc.pid and "core_process" in spawned.info.startup_s
            assert not os.path.exists(core.path) and not os.path.exists(core.dir)
            assert adopted.num_threads == 2  # the adopting replica's count, not the guess
            a, b = await run_all(adopted, jobs), await run_all(spawned, jobs)
            assert [o.new_token_ids for o in a] == [o.new_token_ids for o in b]
            assert [o.new_text for o in a] == [o.new_text for o in b]
        finally:
            adopted.shutdown()
            spawned.shutdown()
        assert core.proc.wait(timeout=10) == 0  # it ended with its front

    in_loop(body)


def test_a_prestarted_core_rebuilds_for_the_adopting_replicas_config(tiny_llama_dir, prestarted):
    core = prestarted(config(tiny_llama_dir, num_kv_blocks=256))

    async def body():
        engine = ProcessEngine(config(tiny_llama_dir, num_kv_blocks=64))
        try:
            assert engine.pid == core.proc.pid and "core_adopted" in engine.info.startup_s
            assert engine.info.num_kv_blocks == 64
            out = await collect(
                engine.generate(engine_request([5, 6, 7], SamplingParams(max_tokens=3)))
            )
            assert len(out.new_token_ids) == 3
        finally:
            engine.shutdown()

    in_loop(body)


def test_a_front_that_loses_the_prestarted_core_to_another_starts_its_own(
    tiny_llama_dir, prestarted
):
    """Two replicas reach the socket: the one the core accepts adopts it, the other's
    connection is dropped and it starts a core of its own."""
    import socket
    from multiprocessing.connection import Connection

    cfg = config(tiny_llama_dir)
    core = prestarted(cfg)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.connect(core.path)  # first in the queue
    first = Connection(other.detach())
    codec = wire.front_codec()
    first.send_bytes(codec.encode(wire.Init(cfg.model_dump(mode="json"), False, 1)))

    async def body():
        engine = ProcessEngine(cfg)
        try:
            assert engine.pid != core.proc.pid and "core_process" in engine.info.startup_s
            # the first comer has the pre-started core
            assert codec.decode(first.recv_bytes()) == wire.Adopted(core.proc.pid)
            assert isinstance(codec.decode(first.recv_bytes()), wire.Ready)
            out = await collect(
                engine.generate(engine_request([5, 6, 7], SamplingParams(max_tokens=3)))
            )
            assert len(out.new_token_ids) == 3
        finally:
            engine.shutdown()
            first.close()  # its "front" leaves: the core ends
        assert core.proc.wait(timeout=10) == 0

    in_loop(body)


def test_a_failed_prestarted_core_leaves_the_replica_to_start_its_own(
    tiny_llama_dir, tmp_path, prestarted
):
    core = prestarted(config(tmp_path / "no-model-here"))
    assert core.proc.wait(timeout=60) == 1  # it could not build, and removed its socket

    async def body():
        engine = ProcessEngine(config(tiny_llama_dir))
        try:
            assert "core_process" in engine.info.startup_s
        finally:
            engine.shutdown()

    in_loop(body)


def test_an_adopted_core_exits_when_its_front_is_killed(tiny_llama_dir, prestarted):
    """The adopted core is not the front's child: it watches the front's pid (and its socket)."""
    from replica.engine.prestart import PRESTARTED_CORE_ENV

    core = prestarted(config(tiny_llama_dir))
    script = textwrap.dedent(f"""
        import asyncio
        from replica.config import EngineConfig
        from replica.engine.core_client import ProcessEngine
        from replica.request import SamplingParams
        from tests.helpers import engine_request

        async def main():
            engine = ProcessEngine(EngineConfig(model={str(tiny_llama_dir)!r}, device="cpu",
                                                block_size=4, num_kv_blocks=256,
                                                max_model_len=256))
            stream = engine.generate(engine_request([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True)))
            await stream.__anext__()
            print(engine.pid, engine.info.startup_s.get("core_adopted"), flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
    """)
    front = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
        env=os.environ | {PRESTARTED_CORE_ENV: core.path},
    )  # fmt: skip
    pid, adopted_s = front.stdout.readline().split()
    assert int(pid) == core.proc.pid and adopted_s != "None"
    front.kill()
    front.wait()
    core.proc.wait(timeout=20)  # raises if it outlives its front by 20 s


def thread_cpus(pid: int) -> dict[str, list[frozenset[int]]]:
    """Each thread's allowed CPUs, by thread name (/proc/PID/task)."""
    out: dict[str, list[frozenset[int]]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            out.setdefault(name, []).append(frozenset(os.sched_getaffinity(int(tid))))
        except (OSError, ProcessLookupError):
            continue  # a thread that just ended
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 CPUs or more")
def test_the_cores_threads_are_pinned_one_to_a_cpu_and_unpinned_when_fewer(tiny_llama_dir):
    """As many torch threads as the process's CPUs: thread i runs on CPU i only (the main
    thread, which runs the steps, is thread 0); the core's other threads on all of them; a
    thread count below the CPUs undoes the pin, the full count pins again; off: never pinned."""
    from replica.layers.cpu_kernels import native_library

    if native_library() is None:
        pytest.skip("no native library (no C compiler)")
    cpus = sorted(os.sched_getaffinity(0))
    everything = frozenset(cpus)

    async def body():
        engine = ProcessEngine(config(tiny_llama_dir), num_threads=len(cpus))
        try:
            assert engine.num_threads == len(cpus)
            assert engine.thread_cpus.startswith("pinned"), engine.thread_cpus
            # a step runs the torch threads (libgomp starts its workers on first use)
            await collect(engine.generate(engine_request([5, 6, 7], SamplingParams(max_tokens=4))))
            masks = [m for ms in thread_cpus(engine.pid).values() for m in ms]
            singles = sorted(next(iter(m)) for m in masks if len(m) == 1)
            assert singles == cpus, thread_cpus(engine.pid)  # one thread on each CPU
            assert any(m == everything for m in masks)  # the IPC and watch threads float
            engine.set_num_threads(1)
            await wait_until(lambda: engine.num_threads == 1)
            assert engine.thread_cpus == f"not pinned (1 threads, {len(cpus)} CPUs)"
            assert all(m == everything for ms in thread_cpus(engine.pid).values() for m in ms)
            engine.set_num_threads(len(cpus))
            await wait_until(lambda: engine.num_threads == len(cpus))
            assert engine.thread_cpus.startswith("pinned")
        finally:
            engine.shutdown()
        off = ProcessEngine(config(tiny_llama_dir, cpu_pin_threads=False), num_threads=len(cpus))
        try:
            assert off.thread_cpus == "not pinned (cpu_pin_threads off)"
            await collect(off.generate(engine_request([5, 6, 7], SamplingParams(max_tokens=4))))
            assert all(m == everything for ms in thread_cpus(off.pid).values() for m in ms)
        finally:
            off.shutdown()

    in_loop(body)
