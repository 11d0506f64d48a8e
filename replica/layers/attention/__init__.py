"""Paged attention over a flat token stream: every layer first writes the step's new K/V into
the block cache by slot, then each request attends to its own blocks with a bottom-right causal
mask. How it attends is a backend (backend.py), picked once by the runner (selector.py): its
builder makes the step's metadata once per step, its impl runs in every layer. flash_attn.py:
flash-attn's paged varlen kernel (CUDA); native_decode.py: the C paged decode kernel (CPU);
torch_sdpa.py: torch SDPA over gathered blocks (everywhere)."""

from replica.layers.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    KVCache,
    StepLayout,
    step_layout,
)
from replica.layers.attention.flash_attn import FlashAttnBackend, FlashAttnMetadata
from replica.layers.attention.flex import FlexAttentionBackend, FlexMetadata
from replica.layers.attention.layer import Attention, attention_layers, set_attention_backend
from replica.layers.attention.native_decode import (
    DecodeBatch,
    NativeDecodeBackend,
    NativeDecodeMetadata,
)
from replica.layers.attention.selector import ATTENTION_BACKENDS, select_attention_backend
from replica.layers.attention.torch_sdpa import (
    DECODE_GROUP_BYTES,
    DEFAULT_DECODE_GROUP_KEYS,
    DecodeGroup,
    PrefillSpan,
    TorchSDPABackend,
    TorchSDPAMetadata,
)

__all__ = [
    "FlexAttentionBackend",
    "FlexMetadata",
    "ATTENTION_BACKENDS",
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "DECODE_GROUP_BYTES",
    "DEFAULT_DECODE_GROUP_KEYS",
    "DecodeBatch",
    "DecodeGroup",
    "FlashAttnBackend",
    "FlashAttnMetadata",
    "KVCache",
    "NativeDecodeBackend",
    "NativeDecodeMetadata",
    "PrefillSpan",
    "StepLayout",
    "attention_layers",
    "TorchSDPABackend",
    "TorchSDPAMetadata",
    "select_attention_backend",
    "set_attention_backend",
    "step_layout",
]
