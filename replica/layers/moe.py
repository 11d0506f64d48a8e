"""A sparse mixture-of-experts MLP: a router picks each token's top-k experts, the rows are
grouped by expert and each active expert runs one fused gate_up GEMM and one down GEMM over its
rows; the weighted outputs are summed back per token. Every expert's intermediate dimension is
split across tensor-parallel ranks like a dense MLP's, so one all-reduce follows the combine."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replica.layers.cpu_kernels import fused_ops_available, silu_mul
from replica.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    default_weight_loader,
)


class Expert(nn.Module):
    """One expert's SwiGLU MLP, this rank's slice of its intermediate dimension. The linears
    are the dense MLP's, so they load their own shard and oneDNN packs them like any other."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel) -> None:
        super().__init__()
        inter = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [inter, inter], False, tp)
        self.down_proj = RowParallelLinear(inter, hidden_size, False, tp)


class Router(nn.Module):
    """The gate: one logit per expert (replicated on every rank)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), each [tokens, top_k]: softmax over all experts in fp32, the k
    largest kept, optionally rescaled to sum to one (Mixtral always, Qwen3-MoE and OLMoE when
    norm_topk_prob)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


class SparseMoeBlock(nn.Module):
    """HF's names: `gate` (the router) and `experts.{e}` (each expert's projections)."""

    fused_cpu_ops = False  # set by the runner: the C kernel for the experts' SiLU

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts "
                f"({num_experts})"
            )
        self.num_experts, self.top_k, self.renormalize, self.tp = (
            num_experts,
            top_k,
            renormalize,
            tp,
        )
        self.gate = Router(hidden_size, num_experts)
        self.experts = nn.ModuleList(
            Expert(hidden_size, intermediate_size, tp) for _ in range(num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.gate.weight), self.top_k, self.renormalize)
        return self.tp.all_reduce(self.combine_experts(x, weights, ids))

    def combine_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """sum_j weights[t, j] * expert[ids[t, j]](x[t]) for every token t (this rank's partial
        sum under tensor parallelism)."""
        num_tokens, top_k = ids.shape
        flat_ids = ids.flatten()
        # slots sorted by expert (stable: a token's contributions keep ascending expert order,
        # the order transformers adds them in)
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of_slot = order // top_k
        rows = x.index_select(0, token_of_slot)
        slot_weights = weights.flatten().index_select(0, order).unsqueeze(1)
        expert_out = torch.empty_like(rows)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count == 0:
                continue
            end = start + count
            gate_up = expert.gate_up_proj(rows[start:end])
            if self.fused_cpu_ops and fused_ops_available(gate_up):
                act = silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            down = expert.down_proj.matmul(act, None)  # reduced once, after the combine
            torch.mul(down, slot_weights[start:end], out=expert_out[start:end])
            start = end
        return x.new_zeros(num_tokens, x.shape[1]).index_add_(0, token_of_slot, expert_out)
