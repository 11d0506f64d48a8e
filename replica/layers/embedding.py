"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the
vocabulary (padded to a multiple of the TP size); lookups are summed, logits gathered."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replica.layers.linear import PackableLinear, TensorParallel, check_shape, narrow_loaded
from replica.quant.weights import QuantizedWeight, new_weight


class VocabParallelEmbedding(nn.Module):
    """The weight may be quantized (replica/quant/weights.py): a lookup then de-quantizes only
    the rows it selects, and the LM head multiplies by the blocks as they are."""

    weight_kind = "embedding"  # which weights a quantized build makes quantized

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TensorParallel,
        shared_weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.vocab_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.vocab_per_rank
        # rows past the real vocabulary (padding on the last rank) stay zero
        self.num_real_rows = max(0, min(vocab_size - self.vocab_start, self.vocab_per_rank))
        self.tied = shared_weight is not None
        if shared_weight is not None:  # tied embeddings: same shape and sharding, no copy
            self.weight = shared_weight
            return
        self.weight = new_weight(
            (self.vocab_per_rank, hidden_size), self.weight_loader, self.weight_kind
        )

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        check_shape((self.vocab_size, self.hidden_size), loaded)
        param.data.zero_()
        n = self.num_real_rows
        if n:
            param.data.narrow(0, 0, n).copy_(narrow_loaded(loaded, 0, self.vocab_start, n))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            return self.weight.lookup(ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = self.lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """logits = h W^T over this rank's vocabulary slice, gathered to the full vocabulary.
    With tied embeddings it is given the embedding's weight (same sharding); packing then keeps
    the row-major weight for the embedding lookup."""

    weight_kind = "lm_head"

    @property
    def release_after_packing(self) -> bool:
        return not self.tied  # a tied weight is the embedding's lookup table

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden, None)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., : self.vocab_size]
