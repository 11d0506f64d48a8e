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
