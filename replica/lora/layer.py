"""The LoRA side of one linear layer (`linear.lora`): every loaded adapter's factors for it,
sharded like the layer's weight, and the step's product: out[rows of adapter g] +=
(x[rows] A_g^T) B_g^T for each adapter g with rows in the step (`LoRABatch`), never a forward
per adapter.

An adapter with many rows in the step (a prompt's chunk) gets its own pair of matmuls over its
slice of rows. Adapters with few rows each (decode) are done together: their rows are gathered
into one [slots, rows per slot, in] block, zero-padded, and multiplied by every slot's factors
at once with two batched matmuls (bmm) over the layer's stacked factors, then added back with
one index_add: a fixed handful of ops per layer, however many adapters share the step (one
pair of matmuls per adapter costs ~5 us of dispatch each, 16 adapters x 4 layers x 30 layers
a step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# an adapter with at most this many rows in a step joins the bundle (bmm); more: its own slice
BUNDLE_MAX_ROWS = 16
# the bundle's block has a row group for every slot up to the highest bundled one: used only
# when the step's bundled adapters fill at least this share of those slots (slots are handed
# out lowest first, so the held adapters fill 1..n); else each goes by its own slice
BUNDLE_MIN_FILL = 0.5


@dataclass
class LoRABundle:
    """The step's few-row adapters as one block: slots 1..`num_slots` by `rows_per_slot` rows,
    `index` the step row each block row takes (padding: row 0, zeroed by `keep`)."""

    num_slots: int
    rows_per_slot: int
    index: torch.Tensor  # long [num_slots * rows_per_slot]
    keep: torch.Tensor  # [num_slots * rows_per_slot, 1], 1 for real rows, 0 for padding


@dataclass
class LoRABatch:
    """The step's token rows grouped by adapter slot, made once per step by the runner:
    `groups` holds (slot, rows) with rows a slice (the adapter's rows are contiguous) or a
    long index tensor; `bundle` the adapters done together. Rows of the base model appear in
    neither."""

    groups: list[tuple[int, slice | torch.Tensor]]
    bundle: LoRABundle | None = None

    @classmethod
    def of(
        cls,
        slots: list[int],
        query_lens: list[int],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> LoRABatch | None:
        """Per request its adapter slot (0: none) and its rows this step, in stream order;
        None when no request runs an adapter (the LoRA path then costs one attribute read)."""
        if not any(slots):
            return None
        spans: dict[int, list[tuple[int, int]]] = {}
        row = 0
        for slot, n in zip(slots, query_lens, strict=True):
            if slot:
                ranges = spans.setdefault(slot, [])
                if ranges and ranges[-1][1] == row:  # extends the previous request's rows
                    ranges[-1] = (ranges[-1][0], row + n)
                else:
                    ranges.append((row, row + n))
            row += n
        # row lists only where they are used: the bundle's few rows and scattered groups (a
        # prompt chunk's thousands of rows stay a slice)
        small = {
            slot: _rows(ranges)
            for slot, ranges in spans.items()
            if sum(e - s for s, e in ranges) <= BUNDLE_MAX_ROWS
        }
        bundle = None
        if len(small) >= 2 and len(small) >= BUNDLE_MIN_FILL * max(small):
            bundle = _bundle(small, device, dtype)
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, ranges in spans.items():
            if bundle is not None and slot in small:
                continue
            if len(ranges) == 1:
                groups.append((slot, slice(*ranges[0])))
            else:
                rows = torch.tensor(_rows(ranges), dtype=torch.long, device=device)
                groups.append((slot, rows))
        return cls(groups, bundle)


def _rows(ranges: list[tuple[int, int]]) -> list[int]:
    return [r for start, end in ranges for r in range(start, end)]


def _bundle(small: dict[int, list[int]], device: torch.device, dtype: torch.dtype) -> LoRABundle:
    num_slots = max(small)
    per_slot = max(len(rows) for rows in small.values())
    index = [0] * (num_slots * per_slot)
    keep = [0.0] * (num_slots * per_slot)
    for slot, rows in small.items():
        base = (slot - 1) * per_slot
        for i, row in enumerate(rows):
            index[base + i] = row
            keep[base + i] = 1.0
    return LoRABundle(
        num_slots,
        per_slot,
        torch.tensor(index, dtype=torch.long, device=device),
        torch.tensor(keep, dtype=dtype, device=device).unsqueeze(1),
    )


@dataclass
class LoRAContext:
    """What every LoRA layer of a model shares: the current step's batch (None between steps
    and in steps without adapter rows)."""

    batch: LoRABatch | None = None


class LoRALinear:
    """One linear layer's adapters: slot -> (A [sum of its parts' ranks, in per rank],
    B [out per rank, sum of ranks]), the scaling folded into B at load; and the same factors
    stacked by slot for the bundle, `a_stack` [slots + 1, in, max rank] and `b_stack`
    [slots + 1, max rank, out] (zero where a slot holds no adapter for this layer, or a lower
    rank), rebuilt when an adapter comes or goes."""

    def __init__(
        self,
        context: LoRAContext,
        weights: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.context = context
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = dict(weights or {})
        self._stacks: tuple[torch.Tensor, torch.Tensor] | None = None

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        self.weights[slot] = (a, b)
        self._stacks = None

    def drop(self, slot: int) -> None:
        if self.weights.pop(slot, None) is not None:
            self._stacks = None

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._stacks is None:
            a0, b0 = next(iter(self.weights.values()))
            num_slots = max(self.weights) + 1
            rank = max(a.shape[0] for a, _ in self.weights.values())
            a_stack = a0.new_zeros(num_slots, a0.shape[1], rank)
            b_stack = b0.new_zeros(num_slots, rank, b0.shape[0])
            for slot, (a, b) in self.weights.items():
                a_stack[slot, :, : a.shape[0]] = a.t()
                b_stack[slot, : b.shape[1]] = b.t()
            self._stacks = (a_stack, b_stack)
        return self._stacks

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add each adapter group's product to its rows of `out` (the base output), in place."""
        batch = self.context.batch
        if batch is None or not self.weights:
            return
        weights = self.weights
        for slot, rows in batch.groups:
            factors = weights.get(slot)
            if factors is None:  # this adapter does not target this layer
                continue
            a, b = factors
            if isinstance(rows, slice):
                out[rows] += F.linear(F.linear(x[rows], a), b)
            else:
                out.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b))
        bundle = batch.bundle
        if bundle is not None:
            a_stack, b_stack = self.stacks()
            n = min(bundle.num_slots, a_stack.shape[0] - 1)  # slots past this layer's: none
            if n <= 0:
                return
            block = bundle.rows_per_slot
            index = bundle.index[: n * block]
            xs = x.index_select(0, index).mul_(bundle.keep[: n * block])
            low = torch.bmm(xs.view(n, block, -1), a_stack[1 : n + 1])
            out.index_add_(0, index, torch.bmm(low, b_stack[1 : n + 1]).view(n * block, -1))
