"""Moving cached KV blocks between replicas (docs/kv-transfer.md): an exporter copies out the
leading run of a prompt's block hashes it holds (pool or tier), with its layout; an importer
whose layout is the same stages the run's blocks that chain from its own hashes of the prompt in
its host tier (kv_tier.py), from where the request's admission restores them as prefix-cache
hits. Nothing is imported that would not equal a recompute: same model weights, dtype, block
size, tensor-parallel shape, and the same token chain."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from replica.request import LoRARequest, extend_block_hashes, root_block_hash

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def weights_fingerprint(model_dir: str | Path) -> str:
    """A cheap identity of a checkpoint: its config.json's bytes and its weight files' names
    and sizes (two replicas of one model, on any node, agree; another model or revision does
    not)."""
    root = Path(model_dir)
    digest = hashlib.blake2b(digest_size=12)
    config = root / "config.json"
    if config.exists():
        digest.update(config.read_bytes())
    for path in sorted(root.iterdir()) if root.is_dir() else [root]:
        if path.is_file() and path.name.endswith(_WEIGHT_SUFFIXES):
            digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
    return digest.hexdigest()


def prompt_block_hashes(
    prompt_token_ids: list[int], block_size: int, lora: LoRARequest | None, num_blocks: int
) -> list[int]:
    """The first `num_blocks` block hashes of a prompt, as its request's chain (Request)."""
    hashes = extend_block_hashes([], list(prompt_token_ids), block_size, root_block_hash(lora))
    return hashes[:num_blocks]


@dataclass
class KVExport:
    """What an exporter sends: its layout, the leading run of the asked hashes it held, and per
    tensor-parallel rank one CPU tensor [blocks, layers, 2, block_size, kv_heads, head_dim]."""

    layout: dict
    hashes: list[int] = field(default_factory=list)
    data: list = field(default_factory=list)  # per rank

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data)


@dataclass
class KVImportResult:
    imported: int = 0  # blocks staged
    offered: int = 0  # blocks the exporter sent
    refused: str | None = None  # why nothing was imported ("layout", ...)
    nbytes: int = 0


def check_import(mine: dict, export: KVExport, expected: list[int]) -> tuple[int, str | None]:
    """How many leading blocks of `export` may be imported (they chain exactly as `expected`,
    the importer's own hashes of the prompt), or 0 and why not."""
    if export.layout != mine:
        diff = {k: (export.layout.get(k), v) for k, v in mine.items() if export.layout.get(k) != v}
        logger.warning("KV import refused: layout differs (theirs, ours): %s", diff)
        return 0, "layout"
    if len(export.data) != mine["tp_size"]:
        return 0, "ranks"
    run = 0
    for theirs, ours in zip(export.hashes, expected):
        if theirs != ours:
            break
        run += 1
    if run == 0:
        return 0, "empty" if not export.hashes else "chain"
    shape = (
        mine["layers"],
        2,
        mine["block_size"],
        mine["kv_heads"],
        mine["head_dim"],
    )
    for tensor in export.data:
        if tuple(tensor.shape[1:]) != shape or tensor.shape[0] < run:
            logger.warning("KV import refused: block shape %s, expected %s", tensor.shape, shape)
            return 0, "shape"
    return run, None


# -- start-up cost figures (RoutingStats) -------------------------------------------------------
MEASURE_TOKENS = 32


def measure_engine(engine) -> dict:
    """The engine's costs for a router's fetch-or-recompute choice, measured once at start-up
    on a pool still empty (well under a second): a lone prefill of MEASURE_TOKENS tokens run
    straight on the runner (no scheduler: no counters, events or cached blocks), and copying
    that prefill's blocks out and back in (the in-process part of an export + import)."""
    import time

    from replica.request import EngineRequest, Request, SamplingParams
    from replica.scheduler import ScheduledRequest, SchedulerOutput

    layout = engine.kv_layout
    out = {"prefill_tokens_per_s": 0.0, "kv_copy_bytes_per_s": 0.0,
           "kv_bytes_per_block": layout["block_bytes"] if layout else 0}  # fmt: skip
    pool = engine.scheduler.kv.pool
    block_size = engine.config.block_size
    tokens = min(MEASURE_TOKENS, engine.max_model_len - 1)
    num_blocks = -(-tokens // block_size)
    if pool.cached or pool.num_free_blocks < pool.num_blocks or num_blocks > pool.num_blocks:
        return out  # blocks in use: nothing may be written
    prompt = [3 + i % max(1, engine.vocab_size - 3) for i in range(tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    request = Request(EngineRequest(prompt, params, "kv-measure"), engine.eos_token_ids)
    block_ids = list(range(num_blocks))
    so = SchedulerOutput([ScheduledRequest(request, 0, tokens, block_ids)], tokens)
    started = time.perf_counter()
    engine.runner.execute(so)
    out["prefill_tokens_per_s"] = round(tokens / max(time.perf_counter() - started, 1e-9), 1)
    engine.runner.execute(SchedulerOutput(finished_request_ids=["kv-measure"]))
    if layout is not None:
        started = time.perf_counter()
        data = engine.runner.export_kv([(b, 0) for b in block_ids])
        parts = data if isinstance(data, list) else [data]
        copies = [t.clone() for t in parts]  # the importer's copy into its tier
        elapsed = max(time.perf_counter() - started, 1e-9)
        out["kv_copy_bytes_per_s"] = round(
            sum(t.numel() * t.element_size() for t in copies) / elapsed
        )
    return out


# -- calling another replica of the deployment (the source of a fetch) ------------------------
def replica_actor_name(app: str, deployment: str, replica_id: str) -> str:
    """Serve's name of a replica's actor (namespace "serve")."""
    return f"SERVE_REPLICA::{app}#{deployment}#{replica_id}"


def call_replica(app: str, deployment: str, replica_id: str, method: str, *args):
    """An ObjectRef of `method(*args)` on one replica of the deployment, called on its actor
    the way Serve's handles call it (the result crosses nodes by Ray's object transfer). Serve
    offers no public call to a chosen replica; this reads its actor protocol (Ray 2.x)."""
    import pickle
    import uuid

    import ray
    from ray.serve._private.common import RequestMetadata

    actor = ray.get_actor(replica_actor_name(app, deployment, replica_id), namespace="serve")
    rid = uuid.uuid4().hex
    metadata = RequestMetadata(
        request_id=rid, internal_request_id=rid, call_method=method, app_name=app
    )
    return actor.handle_request.remote(pickle.dumps(metadata), *args)
