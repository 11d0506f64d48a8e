"""Tensor parallelism over real process groups (gloo on CPU, NCCL on CUDA): tp=2 greedy output is
token-identical to tp=1 and to transformers under chunked prefill and preemption; configuration
errors are clear; a dead or hung worker rank fails the engine in bounded time; no worker process
outlives its group."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import replica.parallel as parallel
from replica.config import EngineConfig
from replica.engine import LLM, AsyncEngine, Engine
from replica.loader import CheckpointError
from replica.parallel import TensorParallelError, TensorParallelRunner
from replica.request import EngineDeadError, SamplingParams
from replica.runner import StepBatch
from replica.runner_protocol import Runner
from tests.helpers import engine_request
from tests.replica.test_model_parity import (
    MAX_TOKENS,
    PROMPT_LENGTHS,
    expected_outputs,
    greedy_params,
    mixed_prompts,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER_KV_BLOCKS = 256


def tp_config(model_dir: Path, tp: int = 2, **fields) -> EngineConfig:
    fields = {"device": "cpu", "block_size": 4, "num_kv_blocks": RUNNER_KV_BLOCKS, **fields}
    return EngineConfig(model=str(model_dir), tensor_parallel_size=tp, **fields)


def is_running(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def worker_pid(runner: TensorParallelRunner) -> int:
    (pid,) = runner.workers.pids.values()
    return pid


@pytest.fixture(scope="class", params=["llama", "qwen2"])
def tp2(request, tiny_llama_dir, tiny_qwen2_dir):
    """A tp=2 runner (rank 0 here, rank 1 a local process) shared by the parity tests; class
    scope, because a process holds one torch.distributed group at a time."""
    model_dir = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[request.param]
    runner = TensorParallelRunner(tp_config(model_dir), model_dir)
    pid = worker_pid(runner)
    yield model_dir, runner
    runner.shutdown()
    assert not is_running(pid), "worker rank outlived shutdown"


# -- parity ------------------------------------------------------------------------------------
class TestParity:
    """tp=2 against tp=1 and transformers, one runner per model for the whole class."""

    @pytest.mark.timeout(120)
    @pytest.mark.parametrize("max_num_batched_tokens", [16, 4096])
    def test_tp2_greedy_matches_tp1_and_transformers(
        self, tp2, run_generation, max_num_batched_tokens
    ):
        """Chunked prefill (16-token budget) and one big step; ranks agree on every step."""
        model_dir, runner = tp2
        prompts = mixed_prompts(0, PROMPT_LENGTHS)
        params = [greedy_params(n) for n in MAX_TOKENS]
        fields = {"block_size": 4, "max_num_batched_tokens": max_num_batched_tokens}
        sharded = run_generation(model_dir, prompts, params, runner=runner, **fields)
        single = run_generation(model_dir, prompts, params, **fields)
        assert sharded.outputs == single.outputs
        assert sharded.outputs == expected_outputs(model_dir, prompts, MAX_TOKENS)

    def test_tp_runner_is_a_runner(self, tp2):
        _, runner = tp2
        assert isinstance(runner, Runner)
        runner.check_health()

    @pytest.mark.timeout(120)
    def test_tp2_preemption_keeps_outputs_identical(self, tp2, run_generation):
        model_dir, runner = tp2
        prompts = mixed_prompts(3, [14, 19, 22, 9, 17, 25, 12, 20])
        # the scheduler gets 24 of the runner's blocks: the largest request needs 11, all ~80
        fields = {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 16}
        sharded = run_generation(model_dir, prompts, greedy_params(16), runner=runner, **fields)
        single = run_generation(model_dir, prompts, greedy_params(16), **fields)
        assert sharded.scheduler.num_preemptions_total > 0
        assert sharded.outputs == single.outputs
        assert sharded.outputs == expected_outputs(model_dir, prompts, [16] * len(prompts))

    @pytest.mark.timeout(120)
    def test_tp2_step_larger_than_one_message(self, tp2, run_generation):
        """A step of ~2,400 tokens does not fit the first broadcast; the rest follows in a second."""
        model_dir, runner = tp2
        lengths = [240 + 7 * i for i in range(9)]
        prompts = mixed_prompts(4, lengths)
        batch_ints = len(parallel.encode_batch(StepBatch(sum(prompts, []), [0], [1], [[0]], [])))
        assert batch_ints > parallel.MESSAGE_CAPACITY
        fields = {"block_size": 4, "max_num_batched_tokens": 4096}
        sharded = run_generation(model_dir, prompts, greedy_params(3), runner=runner, **fields)
        assert sharded.outputs == expected_outputs(model_dir, prompts, [3] * len(prompts))


@pytest.mark.timeout(120)
def test_tp4_replicates_kv_heads_and_matches_transformers(tiny_qwen2_dir, run_generation):
    """2 KV heads over 4 ranks: each rank keeps a copy of the one its query head attends to."""
    runner = TensorParallelRunner(tp_config(tiny_qwen2_dir, tp=4), tiny_qwen2_dir)
    try:
        assert runner.runner.kv_caches[0][0].shape[2] == 1
        prompts = mixed_prompts(9, [3, 18, 11])
        fields = {"block_size": 4, "max_num_batched_tokens": 16}
        run = run_generation(tiny_qwen2_dir, prompts, greedy_params(8), runner=runner, **fields)
    finally:
        runner.shutdown()
    assert run.outputs == expected_outputs(tiny_qwen2_dir, prompts, [8, 8, 8])


def test_batch_encoding_round_trips():
    batch = StepBatch([5, 6, 7, 8], [0, 9, 3], [2, 1, 1], [[4, 2], [7, 1, 3], []], [1, 3])
    assert parallel.decode_batch(parallel.encode_batch(batch)) == batch
    # a pooling step: every rank computes every row of the last layer
    batch.all_rows = True
    assert parallel.decode_batch(parallel.encode_batch(batch)).all_rows


@pytest.mark.timeout(120)
def test_llm_tp2_matches_tp1_and_sizes_kv_for_its_share_of_heads(tiny_llama_dir):
    """Through the public LLM API (make_runner picks the TP runner); kv_cache_bytes is a
    per-rank budget, and each rank holds 1 of the 2 KV heads, so tp=2 gets twice the blocks."""
    # one block: 2 (K, V) x 2 layers x 4 tokens x 1 KV head x 16 dims x 4 bytes = 1 KiB per rank
    fields = {"device": "cpu", "block_size": 4, "kv_cache_bytes": 100 * 1024}
    prompts = ["The key and value", "A block table maps positions", "12, 345"]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    single = LLM(tiny_llama_dir, **fields)
    try:
        expected = [o.text for o in single.generate(prompts, params)]
        assert single.engine.num_kv_blocks == 50
    finally:
        single.shutdown()
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **fields)
    try:
        runner = llm.engine.runner
        assert isinstance(runner, TensorParallelRunner)
        assert runner.runner.kv_block_bytes == 1024
        assert llm.engine.num_kv_blocks == 100
        assert runner.runner.kv_caches[0][0].shape == (100, 4, 1, 16)
        assert [o.text for o in llm.generate(prompts, params)] == expected
    finally:
        llm.shutdown()


# -- configuration errors ----------------------------------------------------------------------
@pytest.fixture
def no_workers(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("workers were started for a configuration that cannot work")

    monkeypatch.setattr(parallel.workers, "_LocalWorkers", refuse)


def test_heads_not_divisible_by_tp_is_rejected_before_workers_start(tiny_llama_dir, no_workers):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by .*\(3\)"):
        TensorParallelRunner(tp_config(tiny_llama_dir, tp=3), tiny_llama_dir)


def test_tp_beyond_visible_gpus_is_rejected(tiny_llama_dir, no_workers, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = tp_config(tiny_llama_dir, tp=2, device="cuda")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 GPUs but 1 are visible"):
        TensorParallelRunner(config, tiny_llama_dir)


def test_placement_group_without_a_bundle_per_rank_is_rejected():
    class FakePlacementGroup:
        bundle_specs = [{"CPU": 1.0}, {"CPU": 0.01}]

    with pytest.raises(ValueError, match="needs a placement group of 4 bundles.*has 2"):
        parallel._check_bundles(FakePlacementGroup(), "cpu", 4)
    with pytest.raises(ValueError, match=r"one GPU per bundle; bundles \[0, 1\]"):
        parallel._check_bundles(FakePlacementGroup(), "cuda", 2)


@pytest.mark.timeout(60)
def test_checkpoint_with_wrong_shapes_is_rejected_and_workers_stopped(
    tiny_llama_dir, tmp_path, monkeypatch
):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    (weights,) = bad.glob("*.safetensors")
    tensors = load_file(weights)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :96].contiguous()  # 128 input columns in the config
    save_file(tensors, weights, metadata={"format": "pt"})

    started: list = []

    class RecordingWorkers(parallel._LocalWorkers):
        def __init__(self, specs):
            super().__init__(specs)
            started.append(self)

    monkeypatch.setattr(parallel.workers, "_LocalWorkers", RecordingWorkers)
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \[64, 96\].*\[64, 128\]"):
        TensorParallelRunner(tp_config(bad), bad)
    (workers,) = started
    assert not any(is_running(pid) for pid in workers.pids.values())


# -- failures ---------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_worker_death_mid_generation_ends_the_request_with_an_error(tiny_qwen2_dir):
    engine = Engine(tp_config(tiny_qwen2_dir))
    pid = worker_pid(engine.runner)

    async def main() -> float:
        async_engine = AsyncEngine(engine)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
            stream = async_engine.generate(engine_request([5, 6, 7], params))
            first = await anext(stream)
            assert first.new_token_ids and not first.finished
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(EngineDeadError, match="rank 1"):
                async with asyncio.timeout(20):
                    async for out in stream:
                        assert not out.finished, "generation finished despite the dead rank"
            waited = time.monotonic() - killed
            with pytest.raises(EngineDeadError, match="rank 1"):
                async_engine.check_health()
            return waited
        finally:
            async_engine.shutdown()

    waited = asyncio.run(main())
    assert waited < 10
    assert not is_running(pid)


@pytest.mark.timeout(60)
def test_worker_death_while_idle_fails_health_and_new_requests(tiny_qwen2_dir):
    engine = Engine(tp_config(tiny_qwen2_dir))
    pid = worker_pid(engine.runner)

    async def main() -> None:
        async_engine = AsyncEngine(engine)
        try:
            async_engine.check_health()
            os.kill(pid, signal.SIGKILL)

            def unhealthy() -> bool:
                try:
                    async_engine.check_health()
                except EngineDeadError:
                    return True
                return False

            # seconds on an idle host; a host whose cores are both busy can take longer to run
            # the killed rank's exit and the runner's watcher thread
            assert wait_until(unhealthy, 30.0)
            with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {pid}\) exited with code -9"):
                async with asyncio.timeout(30):
                    async for _ in async_engine.generate(
                        engine_request([5, 6], SamplingParams(max_tokens=2))
                    ):
                        pass
        finally:
            async_engine.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_hung_worker_fails_the_step_within_the_collective_timeout(tiny_qwen2_dir, run_generation):
    runner = TensorParallelRunner(tp_config(tiny_qwen2_dir), tiny_qwen2_dir, collective_timeout_s=2)
    pid = worker_pid(runner)
    try:
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="[Tt]imed out"):
            run_generation(tiny_qwen2_dir, [[5, 6, 7]], greedy_params(4), runner=runner)
        assert time.monotonic() - started < 10
        with pytest.raises(TensorParallelError):
            runner.check_health()
    finally:
        runner.shutdown()
    assert not is_running(pid)


@pytest.mark.timeout(60)
def test_a_worker_exits_when_the_rank0_process_is_killed(tiny_qwen2_dir):
    """The worker is joining the group when rank 0's process dies (SIGKILL: no cleanup runs);
    it notices (its stdin, held by rank 0, ends) and exits instead of waiting forever."""
    script = (
        "import sys, time\n"
        "import torch.distributed as dist\n"
        "from replica.parallel import RankSpec, _LocalWorkers, _status_key\n"
        "model = sys.argv[1]\n"
        "store = dist.TCPStore('127.0.0.1', 0, world_size=2, is_master=True, "
        "wait_for_workers=False)\n"
        "spec = RankSpec(1, 2, '127.0.0.1', store.port, {'model': model, 'device': 'cpu'}, "
        "model, 1, None, 60.0, 60.0)\n"
        "workers = _LocalWorkers([spec])\n"
        "while not store.check([_status_key('joined', 1)]):\n"
        "    time.sleep(0.05)\n"
        "print(workers.pids[1], flush=True)\n"
        "time.sleep(120)\n"
    )
    rank0 = subprocess.Popen(
        [sys.executable, "-c", script, str(tiny_qwen2_dir)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid = int(rank0.stdout.readline())
        assert is_running(pid)
    finally:
        rank0.kill()
        rank0.wait()
        rank0.stdout.close()
    assert wait_until(lambda: not is_running(pid), 10.0), "worker rank orphaned"


# -- CUDA / NCCL ------------------------------------------------------------------------------------
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for an NCCL tp=2 group"
)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(300)
def test_nccl_tp2_greedy_matches_tp1_on_cuda(tiny_llama_dir, run_generation):
    prompts = mixed_prompts(0, PROMPT_LENGTHS)
    params = [greedy_params(n) for n in MAX_TOKENS]
    fields = {"device": "cuda", "dtype": "float32", "block_size": 4, "max_num_batched_tokens": 16}
    runner = TensorParallelRunner(tp_config(tiny_llama_dir, **fields), tiny_llama_dir)
    try:
        assert runner.runner.device.type == "cuda"
        sharded = run_generation(tiny_llama_dir, prompts, params, runner=runner, **fields)
    finally:
        runner.shutdown()
    single = run_generation(tiny_llama_dir, prompts, params, **fields)
    assert sharded.outputs == single.outputs


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(300)
def test_nccl_worker_death_fails_the_step(tiny_qwen2_dir, run_generation):
    config = tp_config(tiny_qwen2_dir, device="cuda", dtype="float32")
    runner = TensorParallelRunner(config, tiny_qwen2_dir, collective_timeout_s=30)
    pid = worker_pid(runner)
    try:
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            run_generation(tiny_qwen2_dir, [[5, 6, 7]], greedy_params(4), runner=runner)
        assert time.monotonic() - started < 60
    finally:
        runner.shutdown()
    assert not is_running(pid)


@pytest.mark.timeout(180)
def test_llm_tp2_dropped_and_rebuilt_in_one_process(tiny_llama_dir):
    """As in a notebook: `del llm` releases the TP group and its workers (no shutdown call), so
    a second tp=2 LLM can be built in the same process; `with` releases it at the block's end;
    a shut-down LLM refuses to generate with a clear error."""
    import torch.distributed as dist

    fields = {"device": "cpu", "block_size": 4, "num_kv_blocks": 64}
    prompts = ["The key and value", "12, 345"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **fields)
    first = [o.text for o in llm.generate(prompts, params)]
    workers = llm.engine.runner.workers
    pids = list(workers.pids.values())
    del llm  # no gc.collect(): the last reference going is enough
    assert not dist.is_initialized()
    assert all(proc.poll() is not None for proc in workers.procs.values()), pids

    with LLM(tiny_llama_dir, tensor_parallel_size=2, **fields) as llm:
        assert [o.text for o in llm.generate(prompts, params)] == first
        workers = llm.engine.runner.workers
    assert not dist.is_initialized()
    assert all(proc.poll() is not None for proc in workers.procs.values())
    with pytest.raises(RuntimeError, match="this LLM has been shut down"):
        llm.generate(prompts, params)
    llm.shutdown()  # idempotent

    again = LLM(tiny_llama_dir, tensor_parallel_size=2, **fields)
    try:
        assert [o.text for o in again.generate(prompts, params)] == first
    finally:
        again.shutdown()
