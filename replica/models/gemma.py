"""Gemma 2 and Gemma 3 (text) decoders: (1 + w) RMSNorms before and after attention and the
MLP, a gelu-tanh gated MLP, embeddings scaled by sqrt(hidden), query_pre_attn_scalar for the
attention scale, sliding-window (local) layers between global ones, and soft-capped scores:
attention logits (Gemma 2) and final logits (both). Gemma 3 adds q/k RMSNorms and a RoPE base
per layer kind (rope_local_base_freq on local layers; rope_theta and rope_scaling on global)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replica.layers.attention import Attention, AttentionMetadata, KVCache
from replica.layers.cpu_kernels import fused_ops_available
from replica.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from replica.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallel,
    check_shape,
    full_loaded,
)
from replica.layers.norm import RMSNorm
from replica.layers.rotary import RotaryEmbedding, rope_parameters
from replica.models.llama import LlamaForCausalLM, head_dim_of, num_kv_heads_of
from replica.models.windows import SLIDING, layer_types

logger = logging.getLogger(__name__)

SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
# transformers' defaults for the fields an older config.json leaves out
_DEFAULTS = {
    "Gemma2ForCausalLM": {
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 4096,
        "tie_word_embeddings": True,
    },
    "Gemma3ForCausalLM": {
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "sliding_window": 4096,
        "tie_word_embeddings": True,
    },
}


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + w): the checkpoint's w is loaded as 1 + w (in fp32, as transformers
    adds it), so the norm's product, fused or not, is transformers' own."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = self._load_one_plus

    @staticmethod
    def _load_one_plus(param: nn.Parameter, loaded: Any) -> None:
        check_shape(tuple(param.shape), loaded)
        param.data.copy_(1.0 + full_loaded(loaded).float())

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' Gemma order: normalize and scale in fp32, round once
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaAttention(nn.Module):
    fused_cpu_ops = False  # set by the runner: rotary in place by the C kernel (CPU)

    def __init__(
        self,
        hf_config: Any,
        tp: TensorParallel,
        rotary: RotaryEmbedding,
        window: int | None,
        gemma3: bool,
    ) -> None:
        super().__init__()
        hidden, head_dim = hf_config.hidden_size, head_dim_of(hf_config)
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden,
            head_dim,
            hf_config.num_attention_heads,
            num_kv_heads_of(hf_config),
            bias,
            tp,
        )
        self.o_proj = RowParallelLinear(hf_config.num_attention_heads * head_dim, hidden, bias, tp)
        self.q_size, self.kv_size, self.head_dim = (
            self.qkv_proj.q_size,
            self.qkv_proj.kv_size,
            head_dim,
        )
        self.num_heads = self.qkv_proj.num_heads
        self._rotary = (rotary,)  # shared: a tuple keeps it from registering once per layer
        eps = hf_config.rms_norm_eps
        self.q_norm = GemmaRMSNorm(head_dim, eps) if gemma3 else None
        self.k_norm = GemmaRMSNorm(head_dim, eps) if gemma3 else None
        # transformers' Gemma 3 attention takes no soft cap (gemma_config warns if one is set)
        cap = None if gemma3 else hf_config.attn_logit_softcapping
        self.attn = Attention(
            self.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            float(hf_config.query_pre_attn_scalar) ** -0.5,
            sliding_window=window,
            logits_soft_cap=float(cap) if cap else None,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        meta,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention block's output (for the rows in `keep` only, when given)."""
        qkv = self.qkv_proj(hidden)
        num_tokens, d = hidden.shape[0], self.head_dim
        qk_size = self.q_size + self.kv_size
        rotary = self._rotary[0]
        if self.q_norm is None and self.fused_cpu_ops and fused_ops_available(qkv):
            rotary.rotate_(positions, qkv, qk_size // d)  # q and k heads in place
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : qk_size]
        else:
            qk = qkv[:, :qk_size].view(num_tokens, -1, d)
            if self.q_norm is not None:  # Gemma 3: each head normalized before the rotation
                h = self.num_heads
                qk = torch.cat([self.q_norm._norm(qk[:, :h]), self.k_norm._norm(qk[:, h:])], 1)
            qk = rotary.rotate(positions, qk)
            q, k = qk.reshape(num_tokens, qk_size).split([self.q_size, self.kv_size], dim=-1)
        out = self.attn(q, k, qkv[:, qk_size:], kv_cache, meta)
        return self.o_proj(out if keep is None else out.index_select(0, keep))


class GemmaMLP(nn.Module):
    def __init__(self, hf_config: Any, tp: TensorParallel) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"hidden_activation {act!r} is not supported; supported: "
                + ", ".join(SUPPORTED_ACTIVATIONS)
            )
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], False, tp)
        self.down_proj = RowParallelLinear(inter, hidden, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        tp: TensorParallel,
        rotary: RotaryEmbedding,
        window: int | None,
        gemma3: bool,
    ) -> None:
        super().__init__()
        size, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = GemmaAttention(hf_config, tp, rotary, window, gemma3)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = GemmaMLP(hf_config, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normed MLP output, the residual stream before adding it): each residual
        add is done by the pre-norm that follows it (fused where the C kernels run); with
        `keep`, for those rows only (LlamaDecoderLayer's)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, keep)
        if keep is not None:
            residual = residual.index_select(0, keep)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


def _rotaries(hf_config: Any, gemma3: bool) -> dict[str, RotaryEmbedding]:
    """The RoPE of each layer kind ('sliding_attention', 'full_attention')."""
    head_dim, max_pos = head_dim_of(hf_config), int(hf_config.max_position_embeddings)
    if not gemma3:
        theta, scaling = rope_parameters(hf_config)
        rotary = RotaryEmbedding(head_dim, max_pos, theta, scaling)
        return {"sliding_attention": rotary, "full_attention": rotary}
    params = getattr(hf_config, "rope_parameters", None) or {}
    local = dict(params.get("sliding_attention") or {})
    local.setdefault("rope_theta", getattr(hf_config, "rope_local_base_freq", None) or 10000.0)
    full = dict(params.get("full_attention") or getattr(hf_config, "rope_scaling", None) or {})
    full.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 1_000_000.0)
    return {
        kind: RotaryEmbedding(head_dim, max_pos, float(p["rope_theta"]), p)
        for kind, p in (("sliding_attention", local), ("full_attention", full))
    }


class GemmaModel(nn.Module):
    def __init__(self, hf_config: Any, tp: TensorParallel, gemma3: bool) -> None:
        super().__init__()
        size = hf_config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, size, tp)
        # transformers multiplies by sqrt(hidden) held in the weights' dtype
        self.normalizer = float(size) ** 0.5
        rotaries = _rotaries(hf_config, gemma3)
        self.rotary_local = rotaries["sliding_attention"]
        if rotaries["full_attention"] is not self.rotary_local:
            self.rotary_global = rotaries["full_attention"]
        window = int(hf_config.sliding_window)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                hf_config,
                tp,
                rotaries[kind],
                window if kind == SLIDING else None,
                gemma3,
            )
            for kind in layer_types(hf_config)
        )
        self.norm = GemmaRMSNorm(size, hf_config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)
        hidden = embedded * torch.tensor(self.normalizer).to(embedded.dtype)
        residual = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            rows = keep if i == last else None
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, rows)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


def gemma_config(hf_config: Any, arch: str) -> Any:
    """The config with transformers' defaults where config.json leaves a field out; checks what
    this implementation cannot run."""
    for name, value in _DEFAULTS[arch].items():
        if not hasattr(hf_config, name):
            setattr(hf_config, name, value)
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError(
            "use_bidirectional_attention=True (an embedding model's Gemma 3) is not supported; "
            "supported: causal attention (false)"
        )
    if arch == "Gemma3ForCausalLM" and getattr(hf_config, "attn_logit_softcapping", None):
        # transformers' Gemma 3 does not apply it either: follow it, and say so
        logger.warning(
            "attn_logit_softcapping=%s is ignored for Gemma 3, as transformers does",
            hf_config.attn_logit_softcapping,
        )
    return hf_config


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Weights map as Llama's do (fused qkv and gate_up); the LM head is usually tied."""

    gemma3 = False
    supports_join = False  # GemmaModel's forward runs its layers without a join point

    def __init__(self, hf_config: Any, tp: TensorParallel | None = None) -> None:
        nn.Module.__init__(self)
        arch = "Gemma3ForCausalLM" if self.gemma3 else "Gemma2ForCausalLM"
        hf_config = gemma_config(hf_config, arch)
        tp = tp or TensorParallel()
        self.hf_config, self.tp = hf_config, tp
        self.model = GemmaModel(hf_config, tp, self.gemma3)
        self.tie_word_embeddings = bool(hf_config.tie_word_embeddings)
        shared = self.model.embed_tokens.weight if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp, shared)
        cap = getattr(hf_config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(hidden), self.final_logit_softcapping)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    gemma3 = True
