"""A model's LoRA state on one tensor-parallel rank: a `LoRALinear` on every adaptable layer,
the adapters installed in slots (each sharded like the base weights), and each step's
`LoRABatch`. Column-parallel layers (qkv, gate_up) keep A whole and B's rows of this rank's
output shard, through the layer's own weight_loader; row-parallel layers (o_proj, down_proj)
keep A's columns of this rank's input shard and B whole, so each rank's partial product joins
its partial base output before the layer's all-reduce."""

from __future__ import annotations

import torch
from torch import nn

from replica.layers.linear import TensorParallel, narrow_loaded
from replica.lora.layer import LoRABatch, LoRAContext, LoRALinear
from replica.lora.peft import PeftAdapter
from replica.lora.targets import LoRATargets, Target


class LoRAModel:
    def __init__(
        self, model: nn.Module, tp: TensorParallel, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.targets = LoRATargets(model)
        self.tp, self.dtype, self.device = tp, dtype, device
        self.context = LoRAContext()
        self.slot_of: dict[str, int] = {}  # adapter name -> slot (rank 0 names them)
        self.linears: list[nn.Module] = []
        for layer in self.targets.layers:
            for target in layer.values():
                if getattr(target.linear, "lora", None) is None:
                    target.linear.lora = LoRALinear(self.context)
                    self.linears.append(target.linear)

    def add(self, slot: int, adapter: PeftAdapter, name: str | None = None) -> None:
        """Install `adapter` in `slot` (replacing what the slot held)."""
        self.remove(slot)
        per_linear: dict[int, tuple[Target, list]] = {}
        for (layer, module), (a, b) in adapter.factors.items():
            target = self.targets.target(layer, module)
            _, entries = per_linear.setdefault(id(target.linear), (target, []))
            row = 0
            for shard, rows in target.parts:  # a fused checkpoint module: one A, B by parts
                entries.append((shard, a, b[row : row + rows]))
                row += rows
        scaling = adapter.scaling
        for target, entries in per_linear.values():
            if target.row_parallel:
                a_full, b = self._row_parallel(target, entries)
            else:
                a_full, b = self._column_parallel(target, entries)
            target.linear.lora.set(
                slot,
                a_full.to(self.device, self.dtype).contiguous(),
                (b.float() * scaling).to(self.device, self.dtype).contiguous(),
            )
        if name is not None:
            self.slot_of[name] = slot

    def _column_parallel(self, target: Target, entries: list) -> tuple[torch.Tensor, torch.Tensor]:
        linear = target.linear
        rank_sum = sum(a.shape[0] for _, a, _ in entries)
        b_all = torch.zeros(linear.output_size_per_rank, rank_sum)
        col = 0
        for shard, a, b in entries:
            r = a.shape[0]
            part = torch.zeros(linear.output_size_per_rank, r)
            if shard is None:
                linear.weight_loader(part, b.float())
            else:  # this rank's rows of the part, where the base weight keeps them
                linear.weight_loader(part, b.float(), shard)
            b_all[:, col : col + r] = part
            col += r
        return torch.cat([a.float() for _, a, _ in entries]), b_all

    def _row_parallel(self, target: Target, entries: list) -> tuple[torch.Tensor, torch.Tensor]:
        ((_, a, b),) = entries
        n = target.linear.input_size_per_rank
        return narrow_loaded(a.float(), 1, self.tp.rank * n, n), b.float()

    def remove(self, slot: int) -> None:
        for linear in self.linears:
            linear.lora.drop(slot)
        for name in [n for n, s in self.slot_of.items() if s == slot]:
            del self.slot_of[name]

    def slots_of(self, requests) -> list[int]:
        """Each request's adapter slot, 0 for the base model (rank 0, prepare_batch)."""
        slot_of = self.slot_of
        return [0 if r.lora is None else slot_of[r.lora.name] for r in requests]

    def begin_step(self, slots: list[int], query_lens: list[int]) -> None:
        self.context.batch = (
            LoRABatch.of(slots, query_lens, self.device, self.dtype) if slots else None
        )

    def end_step(self) -> None:
        self.context.batch = None
