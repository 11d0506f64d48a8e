"""The attention backends, most specific first, and the choice among them (made once, by the
runner, from its device and config). A new backend is a module with an AttentionBackend subclass,
listed here ahead of the ones it should win over."""

from __future__ import annotations

import logging

from replica.layers.attention.backend import AttentionBackend, AttentionSpec
from replica.layers.attention.flash_attn import FlashAttnBackend
from replica.layers.attention.flex import FlexAttentionBackend
from replica.layers.attention.native_decode import NativeDecodeBackend
from replica.layers.attention.torch_sdpa import TorchSDPABackend

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS: list[type[AttentionBackend]] = [
    FlashAttnBackend,  # CUDA with flash-attn and a block size it pages with
    FlexAttentionBackend,  # CUDA, cuda_attention="flex", block size a multiple of 16
    NativeDecodeBackend,  # CPU fp32/bf16 with the native library, cpu_decode_attention="native"
    TorchSDPABackend,  # everywhere
]


def select_attention_backend(spec: AttentionSpec) -> type[AttentionBackend]:
    """The first backend of ATTENTION_BACKENDS that runs `spec`."""
    for backend in ATTENTION_BACKENDS:
        if backend.supports(spec):
            flex_wanted = spec.device.type == "cuda" and spec.cuda_attention == "flex"
            if flex_wanted and backend is not FlexAttentionBackend:
                if spec.sliding_windows or spec.soft_cap:
                    logger.warning(
                        "cuda_attention='flex' does not run sliding windows %s or soft-capped "
                        "scores (soft cap: %s): attention runs %s instead",
                        list(spec.sliding_windows),
                        spec.soft_cap,
                        backend.name,
                    )
            return backend
    raise ValueError(f"no attention backend runs {spec}")
