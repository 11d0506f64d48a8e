"""Rank 0 of a tensor-parallel group, as the engine's Runner: it starts the workers, joins the
group, broadcasts each step's batch and samples; and it watches the ranks (liveness)."""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import replica.parallel.channel as _channel
import replica.parallel.workers as _workers
from replica.config import EngineConfig
from replica.parallel.channel import (
    _KV_EXPORT,
    _KV_IMPORT,
    _LORA_ADD,
    _LORA_REMOVE,
    _STEP,
    _STOP,
    StepChannel,
    encode_kv_export,
    encode_lora_add,
    gather_kv,
    scatter_kv,
)
from replica.parallel.checks import (
    _check_bundles,
    _check_local_devices,
    check_tensor_parallel_config,
    current_placement_group,
)
from replica.parallel.worker import (
    RankSpec,
    _data_backend,
    _join_group,
    _leave_group,
    _status_key,
)
from replica.request import EngineDeadError
from replica.runner import ModelRunner, StepBatch
from replica.runner_protocol import RunnerOutput
from replica.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# A collective that waits longer than this for a peer fails the step (a hung rank).
DEFAULT_COLLECTIVE_TIMEOUT_S = float(os.environ.get("STEPSERVE_TP_TIMEOUT_S", "120"))
# Workers start (import torch, join the group, load their shard) within this.
DEFAULT_STARTUP_TIMEOUT_S = float(os.environ.get("STEPSERVE_TP_STARTUP_TIMEOUT_S", "600"))


class TensorParallelError(EngineDeadError):
    """A rank of the tensor-parallel group died, hung or failed; the replica must be replaced."""


class TensorParallelRunner:
    """The Runner (runner_protocol.py) of a tensor-parallel group; this object is rank 0.

    `_LocalWorkers`, `_RayWorkers` and `encode_batch` are looked up on their modules
    (replica.parallel.workers, .channel) when used, so a test that patches them there is
    obeyed."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str | Path,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> None:
        """Start ranks 1..tp-1, join the group, load rank 0's shard; returns once every rank
        has loaded its shard (so a replica reports healthy only with its group up)."""
        from replica.loader import load_hf_config

        self.size = tp = config.tensor_parallel_size
        self.config = config
        self.collective_timeout_s = collective_timeout_s
        device_type = config.resolved_device()
        self.backend = _data_backend(device_type)
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialised in this process: it holds one "
                "tensor-parallel group at a time (shut the other runner down first)"
            )
        check_tensor_parallel_config(load_hf_config(model_dir), tp)
        placement_group = current_placement_group()
        if placement_group is not None:
            _check_bundles(placement_group, device_type, tp)
        else:
            _check_local_devices(device_type, tp)

        self.runner: ModelRunner | None = None
        self._failure: str | None = None
        self._failed = threading.Event()
        self._closed = False
        self._joined = False
        self._step_lock = threading.Lock()
        self._threads_before = torch.get_num_threads()
        threads = 1
        if device_type == "cpu":  # rank 0 and the workers share this process's cores
            threads = max(1, self._threads_before // tp)
            torch.set_num_threads(threads)
        master_addr = "127.0.0.1"
        if placement_group is not None:  # STRICT_PACK puts every bundle on this node
            import ray

            master_addr = ray.util.get_node_ip_address()
        # port 0: the store binds a free port itself, so two replicas on a node cannot race
        self._store = dist.TCPStore(
            master_addr,
            0,
            world_size=tp,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=startup_timeout_s),
        )
        specs = [
            RankSpec(
                rank=rank,
                size=tp,
                master_addr=master_addr,
                master_port=self._store.port,
                engine_config=config.model_dump(),
                model_dir=str(model_dir),
                num_threads=threads,
                cuda_device=rank if placement_group is None else None,
                collective_timeout_s=collective_timeout_s,
                startup_timeout_s=startup_timeout_s,
            )
            for rank in range(1, tp)
        ]
        if placement_group is not None:
            self.workers: _workers._LocalWorkers | _workers._RayWorkers = _workers._RayWorkers(
                specs, placement_group
            )
        else:
            self.workers = _workers._LocalWorkers(specs)
        try:
            self._start(model_dir, device_type, time.monotonic() + startup_timeout_s)
        except BaseException:
            self._closed = True
            self.workers.stop(grace_s=0.0)
            if self._joined:
                _leave_group()
            torch.set_num_threads(self._threads_before)
            raise
        self.workers.wait_any_death(self._mark_failed)
        logger.info(
            "tensor-parallel group of %d ranks up (%s, %s): %d KV blocks per rank",
            tp,
            self.backend,
            "Ray actors" if placement_group is not None else "local processes",
            self.num_kv_blocks,
        )

    def _start(self, model_dir: str | Path, device_type: str, deadline: float) -> None:
        self._wait_for_ranks("joined", deadline)
        if device_type == "cuda" and isinstance(self.workers, _workers._LocalWorkers):
            torch.cuda.set_device(0)
        control = _join_group(self._store, 0, self.size, self.backend, self.collective_timeout_s)
        self._joined = True
        self.channel = StepChannel(control)
        self.runner = ModelRunner(self.config, model_dir, 0, self.size, None)
        ready = self._wait_for_ranks("ready", deadline)
        # the scheduler hands out block ids below the smallest rank's pool (ranks size their
        # pools alike, except on GPUs whose free memory differs)
        num_blocks = min([self.runner.num_kv_blocks, *map(int, ready.values())])
        if num_blocks < self.runner.num_kv_blocks:
            self.runner.shrink_kv_cache(num_blocks)

    def _raise_worker_error(self, rank: int) -> None:
        key = _status_key("error", rank)
        if self._store.check([key]):
            error = self._store.get(key).decode()
            raise TensorParallelError(
                f"tensor-parallel worker rank {rank} failed to start:\n{error}"
            )

    def _wait_for_ranks(self, phase: str, deadline: float) -> dict[int, str]:
        """Each worker's value of the store key `phase`; raise on a worker's error or death."""
        values: dict[int, str] = {}
        pending = list(range(1, self.size))
        while True:
            for rank in list(pending):
                self._raise_worker_error(rank)
                if self._store.check([_status_key(phase, rank)]):
                    values[rank] = self._store.get(_status_key(phase, rank)).decode()
                    pending.remove(rank)
            if not pending:
                return values
            death = self.workers.first_death()
            if death is not None:
                for rank in pending:  # it may have reported why just before exiting
                    self._raise_worker_error(rank)
                raise TensorParallelError(f"{death} while starting")
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel workers {pending} did not reach '{phase}' in time"
                )
            time.sleep(0.05)

    # -- liveness ---------------------------------------------------------------------------
    def _mark_failed(self, reason: str) -> None:
        """Record the first failure (a worker's death, a failed step); later calls fail fast."""
        if self._closed or self._failure is not None:
            return
        self._failure = reason
        self._failed.set()
        logger.error("%s; the tensor-parallel group is broken", reason)
        if self.backend == "nccl" and self._joined:
            # an NCCL collective never completes without its peer: abort the communicators
            # so a step stuck in one fails now rather than at the watchdog's timeout
            try:
                dist.distributed_c10d._abort_process_group(dist.group.WORLD)
            except Exception as exc:
                logger.warning("could not abort the NCCL group: %s", exc)

    def check_health(self) -> None:
        """Raise TensorParallelError when a worker rank is gone or a step failed."""
        if self._failure is None and not self._closed:
            death = self.workers.first_death()
            if death is not None:
                self._mark_failed(death)
        if self._failure is not None:
            raise TensorParallelError(self._failure)

    # -- the Runner protocol ----------------------------------------------------------------
    @property
    def kv_sliding_window(self) -> int | None:
        return self.runner.kv_sliding_window

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]:
        return self.runner.kv_group_windows

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def weight_bytes(self) -> dict[str, int]:
        """Rank 0's resident weight bytes (every rank holds its own shard of about as many)."""
        return self.runner.weight_bytes

    @property
    def startup_s(self) -> dict[str, float]:
        """Not timed by phase: the ranks build their engines in their own processes."""
        return {}

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        """Broadcast the step's batch, run rank 0's forward with the others, sample."""
        if self._failure is not None:
            raise TensorParallelError(self._failure)
        if not so.scheduled:
            self.apply_kv_ops(so.kv_ops)
            return RunnerOutput({}, None)
        with self._step_lock:
            if self._closed:
                raise TensorParallelError("the tensor-parallel group is shut down")
            try:
                batch = self.runner.prepare_batch(so)
                self.channel.send(_STEP, _channel.encode_batch(batch))
                return self.runner.execute(so, batch)
            except Exception as exc:
                # a dead peer fails the collective at once; its watcher names the cause
                self._failed.wait(timeout=1.0)
                reason = self._failure or f"tensor-parallel step failed: {exc}"
                self._mark_failed(reason)
                raise TensorParallelError(reason) from exc

    # -- KV tiers and transfer: every rank moves its share of the same blocks ---------------
    @property
    def kv_layout(self) -> dict:
        return self.runner.kv_layout

    def apply_kv_ops(self, ops) -> None:
        """The tier moves alone (no request in the step), on every rank."""
        if not ops:
            return
        batch = StepBatch([], [], [], [], [], kv_ops=list(ops))
        self._broadcast_op(
            _STEP, _channel.encode_batch(batch), lambda: self.runner.apply_kv_ops(ops)
        )

    def export_kv(self, sources: list[tuple[int, int]]) -> list:
        """Each rank's share of the blocks, gathered here (per rank, in rank order)."""

        def local():
            return gather_kv(self.runner.export_kv(sources), self.channel.group, self.size)

        return self._broadcast_op(_KV_EXPORT, encode_kv_export(sources), local)

    def import_kv(self, hashes: list[int], data: list) -> None:
        """Rank r's share of imported blocks (data[r]) into rank r's host tier."""

        def local():
            mine = scatter_kv(list(data), self.channel.group, data[0])
            self.runner.import_kv(hashes, mine)

        self._broadcast_op(_KV_IMPORT, encode_kv_export([(-1, h) for h in hashes]), local)

    # -- LoRA adapters: the same op on every rank, between two steps ------------------------
    @property
    def lora_targets(self):
        return self.runner.lora_targets

    def add_lora(self, slot: int, adapter, name: str | None = None) -> None:
        """Install an adapter rank 0 read (replica.lora.read_adapter) in every rank's slot:
        the others read their copy from its path and keep their shard."""
        self._broadcast_op(_LORA_ADD, encode_lora_add(slot, adapter.path))
        self.runner.add_lora(slot, adapter, name)

    def remove_lora(self, slot: int) -> None:
        self._broadcast_op(_LORA_REMOVE, [slot])
        self.runner.remove_lora(slot)

    def _broadcast_op(self, command: int, payload: list[int], then=None):
        """Send a command to every rank; `then` (rank 0's part, which may join a collective
        with the others) runs under the same lock; its result is returned."""
        if self._failure is not None:
            raise TensorParallelError(self._failure)
        with self._step_lock:
            if self._closed:
                raise TensorParallelError("the tensor-parallel group is shut down")
            self.channel.send(command, payload)
            return then() if then is not None else None

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop the workers (gracefully when the group is idle and healthy, else by kill),
        leave the group and release rank 0's model. No worker outlives this call."""
        if self._closed:
            return
        idle = self._step_lock.acquire(timeout=1.0)
        try:
            self._closed = True
            told_to_stop = False
            if idle and self._failure is None:
                try:
                    self.channel.send(_STOP, [])
                    told_to_stop = True
                except Exception as exc:  # the kill below still ends the workers
                    logger.warning("could not tell the workers to stop: %s", exc)
            self.workers.stop(grace_s if told_to_stop else 0.0)
            # a step stuck in a collective fails now that its peers are gone
            if idle or self._step_lock.acquire(timeout=grace_s):
                idle = True
                _leave_group()
        finally:
            if idle:
                self._step_lock.release()
        if self.runner is not None:
            self.runner.shutdown()
        torch.set_num_threads(self._threads_before)
