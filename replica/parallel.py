"""The tensor-parallel group of one replica: rank 0 runs in the engine's process and drives the
step; ranks 1..tp-1 are Ray actors in the replica's placement group (under Ray Serve) or local
worker processes (without Ray). Each step rank 0 broadcasts a compact batch description, every
rank runs the forward on its shard, and rank 0 samples."""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from replica.config import EngineConfig
from replica.request import EngineDeadError
from replica.runner import ModelRunner, RunnerOutput, StepBatch
from replica.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# A collective that waits longer than this for a peer fails the step (a hung rank).
DEFAULT_COLLECTIVE_TIMEOUT_S = float(os.environ.get("STEPSERVE_TP_TIMEOUT_S", "120"))
# Workers start (import torch, join the group, load their shard) within this.
DEFAULT_STARTUP_TIMEOUT_S = float(os.environ.get("STEPSERVE_TP_STARTUP_TIMEOUT_S", "600"))
# Idle workers wait for the next step on the control group for as long as rank 0 lives.
_CONTROL_TIMEOUT = datetime.timedelta(days=3650)

_STEP, _STOP = 1, 2
# Ints in the first broadcast of a step: a decode step of dozens of requests fits in one
# message; a larger one sends the rest in a second broadcast.
MESSAGE_CAPACITY = 2048


class TensorParallelError(EngineDeadError):
    """A rank of the tensor-parallel group died, hung or failed; the replica must be replaced."""


# -- configuration checks ---------------------------------------------------------------------
def check_tensor_parallel_config(hf_config: Any, tp: int) -> None:
    """Raise ValueError naming the value that cannot be split `tp` ways."""
    from replica.models.llama import num_kv_heads_of

    heads = int(hf_config.num_attention_heads)
    if heads % tp:
        raise ValueError(
            f"num_attention_heads ({heads}) is not divisible by tensor_parallel_size ({tp})"
        )
    kv_heads = num_kv_heads_of(hf_config)
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"num_key_value_heads ({kv_heads}) and tensor_parallel_size ({tp}): one must be a "
            "multiple of the other (KV heads are split, or replicated when there are fewer)"
        )
    inter = int(hf_config.intermediate_size)
    if inter % tp:
        raise ValueError(
            f"intermediate_size ({inter}) is not divisible by tensor_parallel_size ({tp})"
        )


def _check_local_devices(device: str, tp: int) -> None:
    if device != "cuda":
        return  # CPU ranks share the host's cores; torch threads are split between them
    visible = torch.cuda.device_count()
    if tp > visible:
        raise ValueError(
            f"tensor_parallel_size={tp} needs {tp} GPUs but {visible} are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )


def _check_bundles(placement_group: Any, device: str, tp: int) -> None:
    bundles = placement_group.bundle_specs
    if len(bundles) < tp:
        raise ValueError(
            f"tensor_parallel_size={tp} needs a placement group of {tp} bundles (one per rank); "
            f"the replica's has {len(bundles)}"
        )
    if device == "cuda":
        short = [i for i in range(tp) if bundles[i].get("GPU", 0) < 1]
        if short:
            raise ValueError(
                f"tensor_parallel_size={tp} on CUDA needs one GPU per bundle; bundles {short} of "
                f"the replica's placement group have none ({bundles})"
            )


def current_placement_group() -> Any:
    """The placement group this process runs in when it is a Ray worker; None otherwise
    (checked without importing or starting Ray)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    from ray.util import get_current_placement_group

    return get_current_placement_group()


# -- the step channel: rank 0 -> other ranks ------------------------------------------------
def encode_batch(batch: StepBatch) -> list[int]:
    """[num_reqs, num_sampled, starts, query_lens, table lengths, sample rows, token ids,
    block ids] as one flat list of ints."""
    tables = batch.block_ids
    return [
        len(batch.starts),
        len(batch.sample_rows),
        *batch.starts,
        *batch.query_lens,
        *map(len, tables),
        *batch.sample_rows,
        *batch.input_ids,
        *itertools.chain.from_iterable(tables),
    ]


def decode_batch(flat: list[int]) -> StepBatch:
    n, m = flat[0], flat[1]
    i = 2
    starts = flat[i : i + n]
    query_lens = flat[i + n : i + 2 * n]
    table_lens = flat[i + 2 * n : i + 3 * n]
    i += 3 * n
    sample_rows = flat[i : i + m]
    i += m
    num_tokens = sum(query_lens)
    input_ids = flat[i : i + num_tokens]
    i += num_tokens
    tables = []
    for length in table_lens:
        tables.append(flat[i : i + length])
        i += length
    return StepBatch(input_ids, starts, query_lens, tables, sample_rows)


class StepChannel:
    """Broadcasts (command, int payload) messages from rank 0 over a gloo group: one
    fixed-size int32 message (command, length, head of the payload), plus a second broadcast
    for the rest when the payload is longer than the message."""

    def __init__(self, group: Any, capacity: int = MESSAGE_CAPACITY) -> None:
        self.group = group
        self.capacity = capacity
        self.message = torch.zeros(capacity, dtype=torch.int32)

    def send(self, command: int, payload: list[int]) -> None:
        room = self.capacity - 2
        head = torch.tensor([command, len(payload), *payload[:room]], dtype=torch.int32)
        self.message[: head.numel()] = head
        dist.broadcast(self.message, 0, group=self.group)
        if len(payload) > room:
            dist.broadcast(torch.tensor(payload[room:], dtype=torch.int32), 0, group=self.group)

    def receive(self) -> tuple[int, list[int]]:
        dist.broadcast(self.message, 0, group=self.group)
        room = self.capacity - 2
        command, length = int(self.message[0]), int(self.message[1])
        payload = self.message[2 : 2 + min(length, room)].tolist()
        if length > room:
            rest = torch.empty(length - room, dtype=torch.int32)
            dist.broadcast(rest, 0, group=self.group)
            payload += rest.tolist()
        return command, payload


# -- one rank's process group ---------------------------------------------------------------------
@dataclass(frozen=True)
class RankSpec:
    """Everything a worker rank needs to join the group and load its shard (JSON-able)."""

    rank: int
    size: int
    master_addr: str
    master_port: int
    engine_config: dict
    model_dir: str
    num_threads: int
    cuda_device: int | None  # None: the process sees one GPU (a Ray actor) or runs on CPU
    collective_timeout_s: float
    startup_timeout_s: float


def _status_key(phase: str, rank: int) -> str:
    return f"stepserve/{phase}/{rank}"


def _join_group(store: Any, rank: int, size: int, backend: str, timeout_s: float) -> Any:
    """Init the default group (the model's collectives) and return the control group."""
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)


def _leave_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # an aborted group may refuse; the process keeps going
            logger.warning("could not destroy the process group: %s", exc)


def _data_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def run_worker_rank(spec: RankSpec) -> None:
    """Body of ranks 1..tp-1: join the group, load this rank's shard, report ready in the
    store, then run every step rank 0 broadcasts until it says stop (or goes away)."""
    torch.set_num_threads(spec.num_threads)
    store = dist.TCPStore(
        spec.master_addr,
        spec.master_port,
        world_size=spec.size,
        is_master=False,
        timeout=datetime.timedelta(seconds=spec.startup_timeout_s),
    )
    try:
        config = EngineConfig.model_validate(spec.engine_config)
        device_type = config.resolved_device()
        if device_type == "cuda":
            torch.cuda.set_device(spec.cuda_device or 0)
        store.set(_status_key("joined", spec.rank), "1")
        control = _join_group(
            store, spec.rank, spec.size, _data_backend(device_type), spec.collective_timeout_s
        )
        runner = ModelRunner(config, spec.model_dir, spec.rank, spec.size, None)
    except BaseException:
        store.set(_status_key("error", spec.rank), traceback.format_exc())
        raise
    store.set(_status_key("ready", spec.rank), str(runner.num_kv_blocks))
    channel = StepChannel(control)
    try:
        while True:
            command, payload = channel.receive()
            if command == _STOP:
                break
            runner.forward_batch(decode_batch(payload))
    finally:
        runner.shutdown()
        _leave_group()


def _local_worker_entry() -> None:
    """Entry of a local worker process: the spec is the first line on stdin; the end of stdin
    means rank 0's process is gone, so the worker exits rather than outlive it."""
    spec = RankSpec(**json.loads(sys.stdin.readline()))
    logging.basicConfig(
        level=logging.WARNING, format=f"[tp rank {spec.rank}] %(levelname)s %(name)s: %(message)s"
    )

    def exit_with_parent() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=exit_with_parent, name="parent-watch", daemon=True).start()
    try:
        run_worker_rank(spec)
    except BaseException:
        logging.getLogger(__name__).exception("tensor-parallel rank %d failed", spec.rank)
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


class RayRankWorker:
    """A worker rank as a Ray actor (wrapped with ray.remote when the group starts)."""

    def run(self, spec: dict) -> None:
        run_worker_rank(RankSpec(**spec))


# -- the workers, as local processes or Ray actors ----------------------------------------------
class _LocalWorkers:
    def __init__(self, specs: list[RankSpec]) -> None:
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.procs: dict[int, subprocess.Popen] = {}
        for spec in specs:
            env["OMP_NUM_THREADS"] = str(spec.num_threads)
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from replica.parallel import _local_worker_entry as m; m()",
                ],
                stdin=subprocess.PIPE,
                env=env,
                text=True,
            )
            proc.stdin.write(json.dumps(asdict(spec)) + "\n")
            proc.stdin.flush()
            self.procs[spec.rank] = proc

    @property
    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self.procs.items()}

    def first_death(self) -> str | None:
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return (
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}"
                )
        return None

    def wait_any_death(self, on_death) -> None:
        """Call on_death(reason) from a watcher thread when a worker exits."""
        for rank, proc in self.procs.items():

            def watch(rank=rank, proc=proc) -> None:
                code = proc.wait()
                on_death(
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}"
                )

            threading.Thread(target=watch, name=f"tp-watch-{rank}", daemon=True).start()

    def stop(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()  # SIGKILL: also ends a stopped or hung worker
                proc.wait()
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass


class _RayWorkers:
    def __init__(self, specs: list[RankSpec], placement_group: Any) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        actor_class = ray.remote(RayRankWorker)
        self.actors: dict[int, Any] = {}
        self.runs: dict[int, Any] = {}
        for spec in specs:
            bundle = placement_group.bundle_specs[spec.rank]
            actor = actor_class.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=spec.rank
                ),
            ).remote()
            self.actors[spec.rank] = actor
            self.runs[spec.rank] = actor.run.remote(asdict(spec))

    def _reason(self, rank: int) -> str:
        try:
            self._ray.get(self.runs[rank], timeout=1)
            detail = "returned"
        except Exception as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        return f"tensor-parallel worker rank {rank} (Ray actor) ended: {detail}"

    def first_death(self) -> str | None:
        refs = list(self.runs.values())
        done, _ = self._ray.wait(refs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = next(r for r, ref in self.runs.items() if ref == done[0])
        return self._reason(rank)

    def wait_any_death(self, on_death) -> None:
        def watch() -> None:
            try:
                done, _ = self._ray.wait(list(self.runs.values()), num_returns=1)
                rank = next(r for r, ref in self.runs.items() if ref == done[0])
                on_death(self._reason(rank))
            except Exception as exc:  # Ray itself is going away
                on_death(f"lost track of the tensor-parallel workers: {exc}")

        threading.Thread(target=watch, name="tp-watch", daemon=True).start()

    def stop(self, grace_s: float) -> None:
        self._ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=grace_s)
        for actor in self.actors.values():
            self._ray.kill(actor, no_restart=True)


# -- rank 0 ------------------------------------------------------------------------------------------
class TensorParallelRunner:
    """ModelRunner's interface over a tensor-parallel group; this object is rank 0."""

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
            self.workers: _LocalWorkers | _RayWorkers = _RayWorkers(specs, placement_group)
        else:
            self.workers = _LocalWorkers(specs)
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
        if device_type == "cuda" and isinstance(self.workers, _LocalWorkers):
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
            self.runner.kv_caches = [
                (k[:num_blocks], v[:num_blocks]) for k, v in self.runner.kv_caches
            ]
            self.runner.num_kv_blocks = num_blocks

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

    # -- ModelRunner's interface -----------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        """Broadcast the step's batch, run rank 0's forward with the others, sample."""
        if self._failure is not None:
            raise TensorParallelError(self._failure)
        if not so.scheduled:
            return self.runner.execute(so)
        with self._step_lock:
            if self._closed:
                raise TensorParallelError("the tensor-parallel group is shut down")
            try:
                batch = self.runner.prepare_batch(so)
                self.channel.send(_STEP, encode_batch(batch))
                return self.runner.execute(so, batch)
            except Exception as exc:
                # a dead peer fails the collective at once; its watcher names the cause
                self._failed.wait(timeout=1.0)
                reason = self._failure or f"tensor-parallel step failed: {exc}"
                self._mark_failed(reason)
                raise TensorParallelError(reason) from exc

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
