"""bench/probes/prefill_noise.py's stand-in for the stack's wake-ups: the C loop builds and spins."""

import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def test_the_noise_loop_wakes_and_spins(tmp_path):
    from bench.probes.prefill_noise import build_noise

    binary = build_noise(tmp_path)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([str(binary), "200", "2000"])  # 200 wakes/s, 2 ms spin each: 40%
    time.sleep(1.0)
    assert proc.poll() is None, "the noise loop exited"
    proc.kill()
    proc.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    # ~0.4 s of CPU on an idle host; a loaded one still gives it a good share of a second
    assert 0.05 < cpu < 0.9, cpu
