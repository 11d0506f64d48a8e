"""Decode steps as CUDA graphs (flex attention backend, one rank): the model and the LM head of a
decode-only step of 1, 2, 4 .. max_batch requests are captured once at start-up over inputs at
fixed addresses; a step copies its token ids, positions, cache slots and block tables into
them, replays the graph of the next size up (the extra lanes run on the sink block) and reads
the first rows of the logits. Eager launches of a small model's ~15 kernels a layer cost more
than its decode step's memory traffic; a replay launches them all at once.

With capture=False (CPU tests) `run` executes the same padded, fixed-address forward eagerly,
so the padding, the buffers and their refill are tested on any host."""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from replica.layers.attention.backend import KVCache
from replica.layers.attention.flex import DECODE_BUCKETS, DecodeBatch, FlexMetadata

logger = logging.getLogger(__name__)


# What DecodeGraphs reads of the ModelRunner (replica/runner.py) and of its StepBatch; typed here
# so that this module does not import the runner, which imports it.
class _Runner(Protocol):
    device: torch.device
    block_size: int
    attn_builder: Any  # the flex backend's metadata builder
    model: Any
    kv_caches: list[KVCache]


class _Batch(Protocol):
    input_ids: list[int]
    starts: list[int]
    query_lens: list[int]
    block_ids: list[list[int]]
    sample_rows: list[int]


class DecodeGraphs:
    def __init__(self, runner: _Runner, max_batch: int, capture: bool) -> None:
        self.runner = runner
        self.capture = capture
        self.sizes = [s for s in DECODE_BUCKETS if s <= max_batch] or [DECODE_BUCKETS[0]]
        if max_batch not in self.sizes and max_batch < DECODE_BUCKETS[-1]:
            # the next bucket up holds max_batch
            self.sizes.append(next(s for s in DECODE_BUCKETS if s > max_batch))
        self.max_batch = self.sizes[-1]
        device = runner.device
        builder = runner.attn_builder
        self.sink_slot = builder.sink * runner.block_size
        top = self.max_batch
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), self.sink_slot, dtype=torch.long, device=device)
        self.buffers = {lanes: builder.static_decode(lanes) for lanes in self.sizes}
        self.meta = {
            lanes: FlexMetadata(
                slot_mapping=self.slots[:lanes],
                decode=DecodeBatch(
                    torch.arange(lanes, device=device), lanes, self.buffers[lanes].mask
                ),
                prefill=None,
            )
            for lanes in self.sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0
        self.replays = 0  # graph replays
        self.runs = 0  # decode steps run here (replayed, or eagerly without capture)

    def fits(self, batch: _Batch) -> bool:
        """A decode-only step whose every row is sampled, in order, within the largest graph."""
        n = len(batch.query_lens)
        return (
            0 < n <= self.max_batch
            and all(q == 1 for q in batch.query_lens)
            and len(batch.sample_rows) == n
            and batch.sample_rows == list(range(n))
        )

    def _lanes(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _forward(self, lanes: int) -> torch.Tensor:
        runner = self.runner
        hidden = runner.model(
            self.ids[:lanes], self.positions[:lanes], runner.kv_caches, self.meta[lanes]
        )
        return runner.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Warm up (compiles each size's kernels) and capture every size, largest first, in
        one memory pool; the sink lanes' inputs fill the buffers meanwhile."""
        if not self.capture:
            return
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            for lanes in reversed(self.sizes):
                for _ in range(2):
                    self._forward(lanes)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[lanes] = self._forward(lanes)
                self.graphs[lanes] = graph
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        torch.cuda.synchronize(self.runner.device)
        self.capture_s = time.perf_counter() - started
        logger.info(
            "captured %d decode CUDA graphs (batches %s) in %.1f s",
            len(self.graphs),
            self.sizes,
            self.capture_s,
        )

    def run(self, batch: _Batch) -> torch.Tensor:
        """Logits [n, vocab] of a decode step that `fits`."""
        n = len(batch.query_lens)
        lanes = self._lanes(n)
        bs = self.runner.block_size
        positions = torch.tensor(batch.starts, dtype=torch.long)
        slots = torch.tensor(
            [ids[p // bs] * bs + p % bs for ids, p in zip(batch.block_ids, batch.starts)],
            dtype=torch.long,
        )
        ids = torch.tensor(batch.input_ids, dtype=torch.long)
        self._fill(self.ids, ids, lanes, 0)
        self._fill(self.positions, positions, lanes, 0)
        self._fill(self.slots, slots, lanes, self.sink_slot)
        self.runner.attn_builder.fill_decode(self.buffers[lanes], batch.starts, batch.block_ids)
        self.runs += 1
        if self.capture:
            self.graphs[lanes].replay()
            self.replays += 1
            return self.logits[lanes][:n]
        return self._forward(lanes)[:n]

    @staticmethod
    def _fill(buffer: torch.Tensor, values: torch.Tensor, lanes: int, pad: int) -> None:
        n = values.shape[0]
        host = torch.full((lanes,), pad, dtype=buffer.dtype)
        host[:n] = values
        buffer[:lanes].copy_(host, non_blocking=True)

    def stats(self) -> dict[str, Any]:
        return {
            "sizes": self.sizes,
            "capture_s": round(self.capture_s, 3),
            "replays": self.replays,
            "runs": self.runs,
        }
