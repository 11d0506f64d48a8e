"""One rank's membership of the group (shared with rank 0) and the body of ranks 1..tp-1: as a
local process (`_local_worker_entry`) or a Ray actor (`RayRankWorker`)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from replica.config import EngineConfig
from replica.parallel.channel import (
    _KV_EXPORT,
    _KV_IMPORT,
    _LORA_ADD,
    _LORA_REMOVE,
    _STOP,
    StepChannel,
    decode_batch,
    decode_kv_export,
    decode_lora_add,
    gather_kv,
    scatter_kv,
)
from replica.runner import ModelRunner

logger = logging.getLogger(__name__)

# Idle workers wait for the next step on the control group for as long as rank 0 lives.
_CONTROL_TIMEOUT = datetime.timedelta(days=3650)


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
            if command == _LORA_ADD:  # rank 0 read and checked it: read this rank's copy
                from replica.lora import read_adapter

                slot, path = decode_lora_add(payload)
                adapter = read_adapter(path, path, runner.lora_targets, config.max_lora_rank)
                runner.add_lora(slot, adapter)
            elif command == _LORA_REMOVE:
                runner.remove_lora(payload[0])
            elif command == _KV_EXPORT:  # this rank's share of the blocks, gathered at rank 0
                gather_kv(runner.export_kv(decode_kv_export(payload)), control)
            elif command == _KV_IMPORT:
                hashes = decode_kv_export(payload)
                data = scatter_kv(None, control, runner.kv_block_shape(len(hashes)))
                runner.import_kv([h for _, h in hashes], data)
            else:
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
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


class RayRankWorker:
    """A worker rank as a Ray actor (wrapped with ray.remote when the group starts)."""

    def run(self, spec: dict) -> None:
        run_worker_rank(RankSpec(**spec))
