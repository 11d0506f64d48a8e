"""The LoRA side of one linear layer (`linear.lora`): every loaded adapter's factors for it,
sharded like the layer's weight, and the step's product: out[rows of adapter g] +=
(x[rows] A_g^T) B_g^T for each adapter g with rows in the step (`LoRABatch`), one pair of
matmuls per adapter group, never a forward per adapter."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class LoRABatch:
    """The step's token rows grouped by adapter slot, made once per step by the runner:
    `groups` holds (slot, rows) with rows a slice (the adapter's rows are contiguous) or a
    long index tensor. Rows of the base model appear in no group."""

    groups: list[tuple[int, slice | torch.Tensor]]

    @classmethod
    def of(cls, slots: list[int], query_lens: list[int], device: torch.device) -> LoRABatch | None:
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
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, ranges in spans.items():
            if len(ranges) == 1:
                groups.append((slot, slice(*ranges[0])))
            else:
                rows = [r for start, end in ranges for r in range(start, end)]
                groups.append((slot, torch.tensor(rows, dtype=torch.long, device=device)))
        return cls(groups)


@dataclass
class LoRAContext:
    """What every LoRA layer of a model shares: the current step's batch (None between steps
    and in steps without adapter rows)."""

    batch: LoRABatch | None = None


@dataclass
class LoRALinear:
    """One linear layer's adapters: slot -> (A [sum of its parts' ranks, in per rank],
    B [out per rank, sum of ranks]); the scaling is folded into B at load."""

    context: LoRAContext
    weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add each adapter group's product to its rows of `out` (the base output), in place."""
        batch = self.context.batch
        if batch is None:
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
