"""The CPU KV cache's pages are mapped ahead of use by an idle-priority thread (kv_prefault.py):
which pages become resident (read back with mincore), that contents survive, the window's
bounds, and the runner's wiring (the frontier a step reports, shutdown, garbage collection)."""

from __future__ import annotations

import ctypes
import gc
import mmap

import pytest
import torch

from replica import kv_prefault
from replica.config import EngineConfig
from replica.kv_prefault import KVPrefaulter
from replica.request import SamplingParams
from replica.runner import ModelRunner, zero_pages

PAGE = mmap.PAGESIZE
BLOCK_SHAPE = (16, 4, 64)  # 16 KiB of fp32 per block: 4 pages each
NUM_BLOCKS = 64

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_pages(t: torch.Tensor) -> list[bool]:
    """Per page of t's (page-aligned) memory: is it resident (mincore)?"""
    length = t.numel() * t.element_size()
    vec = ctypes.create_string_buffer(-(-length // PAGE))
    assert _libc.mincore(t.data_ptr(), length, vec) == 0, ctypes.get_errno()
    return [bool(b & 1) for b in vec.raw]


def resident_blocks(t: torch.Tensor) -> list[bool]:
    """Per block of t (a whole number of pages each): are all its pages resident?"""
    per_block = t[0].numel() * t.element_size() // PAGE
    flags = resident_pages(t)
    return [all(flags[i * per_block : (i + 1) * per_block]) for i in range(t.shape[0])]


def populate_supported() -> bool:
    probe = zero_pages((1, PAGE // 4), torch.float32)
    return kv_prefault.populate(probe.data_ptr(), PAGE)


needs_populate = pytest.mark.skipif(
    not populate_supported(), reason="this kernel lacks MADV_POPULATE_WRITE (Linux 5.14+)"
)


@needs_populate
def test_the_window_ahead_becomes_resident_and_contents_survive():
    tensors = [zero_pages((NUM_BLOCKS, *BLOCK_SHAPE), torch.float32) for _ in range(2)]
    tensors[0][0].fill_(1.5)  # written before the thread runs: must keep its values
    assert resident_blocks(tensors[1]) == [False] * NUM_BLOCKS
    prefaulter = KVPrefaulter(tensors, ahead_blocks=8)
    try:
        assert prefaulter.wait(8, timeout=30)
        for t in tensors:
            assert resident_blocks(t) == [True] * 8 + [False] * (NUM_BLOCKS - 8)
        assert prefaulter.priority in ("SCHED_IDLE", "nice 19")
        prefaulter.need(20)  # a step used blocks below 20
        assert prefaulter.wait(28, timeout=30)
        for t in tensors:
            assert resident_blocks(t) == [True] * 28 + [False] * (NUM_BLOCKS - 28)
        prefaulter.shrink(30)  # blocks from 30 on are never used
        prefaulter.need(60)
        assert prefaulter.wait(30, timeout=30) and prefaulter.done
        assert prefaulter.populated_blocks == 30
        assert resident_blocks(tensors[1]) == [True] * 30 + [False] * (NUM_BLOCKS - 30)
        assert torch.all(tensors[0][0] == 1.5) and torch.all(tensors[0][1:] == 0)
        assert torch.all(tensors[1] == 0) and prefaulter.error is None
    finally:
        prefaulter.close()
    assert not prefaulter._thread.is_alive()


@needs_populate
def test_the_thread_yields_to_busy_cpus_and_catches_up_when_they_idle():
    """Idle priority: while a process spins on every CPU at normal priority the thread gets
    (almost) no time (SCHED_IDLE weighs 3 against 1024, nice 19 15); once they stop it maps the
    rest. 8192 blocks of 4 pages (128 MiB) take ~70 ms of CPU to map on an Intel host (2 us a
    page) and ~5x that on an AMD one, more than the thread got in 1.5 s beside the spinners
    (a CI run on the Intel host mapped 1024 blocks, 16 MiB, 11 ms of CPU, within them). The
    catch-up may meet a busy host's other load: it has 120 s."""
    import os
    import subprocess
    import sys
    import time

    blocks = 8192
    tensors = [zero_pages((blocks, *BLOCK_SHAPE), torch.float32)]
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(len(os.sched_getaffinity(0)))
    ]
    try:
        time.sleep(0.3)  # the spinners are running
        prefaulter = KVPrefaulter(tensors, ahead_blocks=blocks)
        time.sleep(1.5)
        assert prefaulter.populated_blocks < blocks, prefaulter.priority
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert prefaulter.wait(blocks, timeout=120)
    assert all(resident_blocks(tensors[0]))
    prefaulter.close()


def test_refused_advice_leaves_the_pages_to_fault_in(monkeypatch):
    """A kernel without MADV_POPULATE_WRITE: the thread stops, nothing breaks."""
    monkeypatch.setattr(kv_prefault, "_unsupported", True)
    tensors = [zero_pages((NUM_BLOCKS, *BLOCK_SHAPE), torch.float32)]
    prefaulter = KVPrefaulter(tensors, ahead_blocks=4)
    prefaulter._thread.join(10)
    assert not prefaulter._thread.is_alive() and prefaulter.populated_blocks == 0
    assert prefaulter.done and prefaulter.error is None
    tensors[0][3].fill_(2.0)  # the cache still works: first writes fault in as before
    assert torch.all(tensors[0][3] == 2.0)


@needs_populate
def test_runner_keeps_the_pages_above_the_blocks_in_use_mapped(tiny_llama_dir, run_generation):
    ahead = 10
    # the tiny model's block: 2 layers' K and V of block_size 16 x its KV heads x head dim
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=512)
    runner = ModelRunner(config, tiny_llama_dir)
    block_mib = runner.kv_block_bytes / (1 << 20)
    runner.shutdown()
    mib = max(1, round(ahead * block_mib))
    run = run_generation(
        tiny_llama_dir,
        [[5 + i for i in range(40)], [7] * 70],
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        num_kv_blocks=4096,
        block_size=16,
        cpu_kv_prefault_mib=mib,
    )
    prefaulter = run.runner.kv_prefault
    # the pool never wrapped: blocks 0..used-1 were handed out in order, the free queue starts
    # with the first never used
    used = next(iter(run.scheduler.kv.pool.free_queue)).block_id
    assert 7 <= used < 64
    expected = min(4096, used + prefaulter.ahead_blocks)
    assert prefaulter.ahead_blocks == max(1, (mib << 20) // run.runner.kv_block_bytes)
    assert prefaulter._target == expected
    assert prefaulter.wait(expected, timeout=60)
    # the tiny model's blocks are smaller than a page: the pages that hold blocks below
    # `expected` are resident, those wholly above it are not
    for k, v in run.runner.kv_caches:
        for t in (k, v):
            pages = resident_pages(t)
            mapped = -(-expected * t[0].numel() * t.element_size() // PAGE)
            assert all(pages[:mapped]) and not any(pages[mapped:]), (mapped, pages.index(False))
    run.runner.shutdown()
    assert run.runner.kv_prefault is None and not prefaulter._thread.is_alive()


def test_runner_without_prefault_and_a_dropped_runner_stops_its_thread(tiny_llama_dir):
    off = ModelRunner(
        EngineConfig(
            model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64, cpu_kv_prefault_mib=0
        ),
        tiny_llama_dir,
    )
    assert off.kv_prefault is None
    runner = ModelRunner(
        EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64), tiny_llama_dir
    )
    thread = runner.kv_prefault._thread
    assert thread.is_alive() or runner.kv_prefault.done
    del runner
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_prefault_leaves_greedy_outputs_unchanged(tiny_llama_dir, run_generation):
    prompts = [[3 + (i * 7) % 200 for i in range(n)] for n in (5, 33, 47)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    on = run_generation(tiny_llama_dir, prompts, params, block_size=4, cpu_kv_prefault_mib=1)
    off = run_generation(tiny_llama_dir, prompts, params, block_size=4, cpu_kv_prefault_mib=0)
    assert on.runner.kv_prefault is not None and off.runner.kv_prefault is None
    assert on.outputs == off.outputs
