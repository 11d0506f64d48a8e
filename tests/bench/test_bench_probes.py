"""The benchmarks' probes of the serving stack: stopping a set of server processes while a rate
is measured (ttft_decompose --freeze), moving them to another scheduling class (idle_noise's
STEPSERVE_PROBE_DEMOTE) and lone requests with a gap before each (offline_throughput
--one-at-a-time). Each on a child process of its own, with no Ray and no model."""

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SLEEPER = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); " \
    "time.sleep(60)  # stepserve-probe-target"  # fmt: skip


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def stopped(pid: int, expected: bool) -> bool:
    """Whether the process reaches that state within 5 s (a signal lands asynchronously)."""
    deadline = time.monotonic() + 5
    while (state(pid) == "T") != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def child():
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER])
    deadline = time.monotonic() + 10
    while len(os.listdir(f"/proc/{proc.pid}/task")) < 2:  # its second thread has started
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return proc


def test_freeze_stops_only_the_matching_processes_of_the_session_for_the_block():
    from bench.probes.idle_noise import process_table
    from bench.probes.ttft_decompose import frozen

    target, other = child(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # the same command line in another session (another server, another test run): untouched
    elsewhere = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    procs = (target, other, elsewhere)
    try:
        with frozen("stepserve-probe-target", process_table(cmd_chars=None), os.getsid(0)) as pids:
            assert pids == [target.pid]
            assert stopped(target.pid, True)
            assert state(other.pid) != "T" and state(elsewhere.pid) != "T"
        assert stopped(target.pid, False)
        with frozen(None, process_table(cmd_chars=None), os.getsid(0)) as pids:  # no --freeze
            assert pids == []
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_freeze_refuses_a_sweep_too_long_to_stop_the_gcs_for(monkeypatch):
    import argparse

    import pytest

    from bench.probes.ttft_decompose import check_freeze

    args = argparse.Namespace(freeze=["stepserve+haproxy@f:ServeController"], num_prompts=60)
    check_freeze(args, ["2", "4"])  # 30 s at the slowest
    with pytest.raises(SystemExit, match="60 prompts"):
        check_freeze(args, ["1", "2"])
    args.freeze = ["no-pattern"]
    with pytest.raises(SystemExit, match="SYSTEM:REGEX"):
        check_freeze(args, ["4"])
    args.freeze = []
    check_freeze(args, ["0.1"])  # nothing frozen, any length


def test_demote_moves_every_thread_not_only_the_main_one():
    from bench.probes.idle_noise import demote

    proc = child()
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tids) == 2
        assert demote([proc.pid, os.getpid()], "stepserve-probe-target:batch") == 2
        for tid in tids:
            assert os.sched_getscheduler(tid) == os.SCHED_BATCH
            assert os.getpriority(os.PRIO_PROCESS, tid) == 19
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this process did not match
        assert demote([proc.pid], "stepserve-probe-target:idle") == 2
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}
    finally:
        proc.kill()
        proc.wait()


def test_one_at_a_time_times_each_request_alone_after_its_gap():
    from bench.offline_throughput import one_at_a_time

    calls, per_request = [], []

    def generate(prompt, n):
        calls.append((time.perf_counter(), prompt, n))
        time.sleep(0.02)
        return (prompt, n)

    started = time.perf_counter()
    outs = one_at_a_time(generate, [[1], [2, 3]], [1, 4], per_request, gap=0.5)
    assert outs == [([1], 1), ([2, 3], 4)]
    assert [c[1:] for c in calls] == [([1], 1), ([2, 3], 4)]
    assert calls[0][0] - started >= 0.5 and calls[1][0] - calls[0][0] >= 0.52  # gap, then work
    # each request's own time, not its gap
    assert len(per_request) == 2 and all(0.02 <= t < 0.4 for t in per_request), per_request
