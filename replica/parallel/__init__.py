"""The tensor-parallel group of one replica: rank 0 runs in the engine's process and drives the
step; ranks 1..tp-1 are Ray actors in the replica's placement group (under Ray Serve) or local
worker processes (without Ray). Each step rank 0 broadcasts a compact batch description, every
rank runs the forward on its shard, and rank 0 samples. By job: checks.py (does the size fit),
channel.py (the batch on the wire), worker.py (ranks 1..tp-1), workers.py (them, seen from rank
0), runner.py (rank 0 and liveness)."""

from replica.parallel.channel import MESSAGE_CAPACITY, StepChannel, decode_batch, encode_batch
from replica.parallel.checks import (
    _check_bundles,
    _check_local_devices,
    check_tensor_parallel_config,
    current_placement_group,
)
from replica.parallel.runner import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    TensorParallelError,
    TensorParallelRunner,
)
from replica.parallel.worker import (
    RankSpec,
    RayRankWorker,
    _local_worker_entry,
    _status_key,
    run_worker_rank,
)
from replica.parallel.workers import _LocalWorkers, _RayWorkers

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DEFAULT_STARTUP_TIMEOUT_S",
    "MESSAGE_CAPACITY",
    "RankSpec",
    "RayRankWorker",
    "StepChannel",
    "TensorParallelError",
    "TensorParallelRunner",
    "_LocalWorkers",
    "_RayWorkers",
    "_check_bundles",
    "_check_local_devices",
    "_local_worker_entry",
    "_status_key",
    "check_tensor_parallel_config",
    "current_placement_group",
    "decode_batch",
    "encode_batch",
    "run_worker_rank",
]
