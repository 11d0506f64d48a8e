"""The step channel, rank 0 -> the other ranks: a step's batch as a flat list of ints, broadcast
over a gloo group."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from replica.runner import StepBatch

# commands: a step's batch; stop; install a LoRA adapter (slot, its path as bytes) in every
# rank; drop the adapter of a slot; KV blocks out to rank 0 (gathered) and in from it
# (scattered) for a transfer between replicas (replica/kv_transfer.py)
_STEP, _STOP, _LORA_ADD, _LORA_REMOVE, _KV_EXPORT, _KV_IMPORT = 1, 2, 3, 4, 5, 6
# Ints in the first broadcast of a step: a decode step of dozens of requests fits in one
# message; a larger one sends the rest in a second broadcast.
MESSAGE_CAPACITY = 2048


def encode_batch(batch: StepBatch) -> list[int]:
    """[num_reqs, num_sampled, flags (LoRA slots, KV ops, all rows read), starts, query_lens,
    table lengths, sample rows, token ids, block ids, LoRA slots if any, then per further KV
    group (a hybrid model's): its tables' lengths and block ids] as one flat list of ints."""
    tables = batch.block_ids
    flat = [
        len(batch.starts),
        len(batch.sample_rows),
        int(bool(batch.lora_slots)) | int(bool(batch.kv_ops)) << 1 | int(batch.all_rows) << 2,
        *batch.starts,
        *batch.query_lens,
        *map(len, tables),
        *batch.sample_rows,
        *batch.input_ids,
        *itertools.chain.from_iterable(tables),
        *batch.lora_slots,
    ]
    if batch.kv_ops:  # KV tier moves (kv_tier.py): kind, block id, hash in two int32s
        flat.append(len(batch.kv_ops))
        for kind, block_hash, block_id in batch.kv_ops:
            flat += [kind, block_id, *split_hash(block_hash)]
    for group in batch.group_block_ids:
        flat += [*map(len, group), *itertools.chain.from_iterable(group)]
    return flat


def split_hash(block_hash: int) -> tuple[int, int]:
    """A signed 64-bit block hash as two int32s (the channel's ints)."""
    hi, lo = block_hash >> 32, block_hash & 0xFFFFFFFF
    return hi, lo - (1 << 32) if lo >= 1 << 31 else lo


def join_hash(hi: int, lo: int) -> int:
    return (hi << 32) | (lo & 0xFFFFFFFF)


def _tables(flat: list[int], i: int, lengths: list[int]) -> tuple[list[list[int]], int]:
    tables = []
    for length in lengths:
        tables.append(flat[i : i + length])
        i += length
    return tables, i


def decode_batch(flat: list[int]) -> StepBatch:
    n, m, flags = flat[0], flat[1], flat[2]
    has_lora, has_ops, all_rows = flags & 1, flags & 2, bool(flags & 4)
    i = 3
    starts = flat[i : i + n]
    query_lens = flat[i + n : i + 2 * n]
    table_lens = flat[i + 2 * n : i + 3 * n]
    i += 3 * n
    sample_rows = flat[i : i + m]
    i += m
    num_tokens = sum(query_lens)
    input_ids = flat[i : i + num_tokens]
    i += num_tokens
    tables, i = _tables(flat, i, table_lens)
    lora_slots = []
    if has_lora:
        lora_slots = flat[i : i + n]
        i += n
    kv_ops = []
    if has_ops:
        num_ops = flat[i]
        i += 1
        for _ in range(num_ops):
            kind, block_id, hi, lo = flat[i : i + 4]
            kv_ops.append((kind, join_hash(hi, lo), block_id))
            i += 4
    groups = []
    while i < len(flat):  # a hybrid model's further KV groups
        group, i = _tables(flat, i + n, flat[i : i + n])
        groups.append(group)
    batch = StepBatch(input_ids, starts, query_lens, tables, sample_rows, groups, lora_slots)
    batch.kv_ops = kv_ops
    batch.all_rows = all_rows
    return batch


def encode_lora_add(slot: int, path: str) -> list[int]:
    return [slot, *path.encode()]


def decode_lora_add(payload: list[int]) -> tuple[int, str]:
    return payload[0], bytes(payload[1:]).decode()


def encode_kv_export(sources: list[tuple[int, int]]) -> list[int]:
    """(pool block id or -1, block hash) pairs as ints."""
    flat = []
    for block_id, block_hash in sources:
        flat += [block_id, *split_hash(block_hash)]
    return flat


def decode_kv_export(flat: list[int]) -> list[tuple[int, int]]:
    return [(flat[i], join_hash(flat[i + 1], flat[i + 2])) for i in range(0, len(flat), 3)]


def gather_kv(local: torch.Tensor, group: Any, size: int = 0) -> list[torch.Tensor] | None:
    """Every rank's blocks at rank 0 (`size` ranks given there), over the gloo group as bytes
    (gloo moves any dtype so)."""
    raw = local.contiguous().view(torch.uint8)
    if not size:
        dist.gather(raw, None, dst=0, group=group)
        return None
    parts = [torch.empty_like(raw) for _ in range(size)]
    dist.gather(raw, parts, dst=0, group=group)
    return [p.view(local.dtype).view(local.shape) for p in parts]


def scatter_kv(parts: list[torch.Tensor] | None, group: Any, like: torch.Tensor) -> torch.Tensor:
    """Rank r gets parts[r] (given at rank 0) shaped and typed as `like`."""
    out = torch.empty_like(like).view(torch.uint8)
    raws = None if parts is None else [p.contiguous().view(torch.uint8) for p in parts]
    dist.scatter(out, raws, src=0, group=group)
    return out.view(like.dtype).view(like.shape)


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
