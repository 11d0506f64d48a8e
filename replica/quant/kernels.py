"""Matmuls and row look-ups on quantized weights (formats.QuantizedTensor).

REFERENCE implementations only, on the `qload` branch: they de-quantize the whole weight with
QuantizedTensor.dequantize and call F.linear. The native kernels (the kernels work, same
signatures) replace this file; the model and the loader call nothing else of it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replica.quant.formats import QuantizedTensor

ACTIVATION_MODES = ("int8", "fp32")
ACTIVATION_GROUP = 32  # the reference rounds activations to int8 per group of this many


def native_available() -> bool:
    """Whether the native kernels are built and usable here (never, in the reference)."""
    return False


def dequantize(w: QuantizedTensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [rows, cols] of the weight, or of only the given rows (a 1-D index tensor)."""
    device = w.data.device
    data = w.data if rows is None else w.data.index_select(0, rows.to(device, torch.long))
    host = QuantizedTensor(w.qtype, (data.shape[0], w.shape[1]), data.cpu())  # numpy reference
    return host.dequantize().to(device)


def _round_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded as int8 per group of 32 with one scale each (what an int8-activation kernel
    multiplies by), back in fp32."""
    k = x.shape[-1]
    if k % ACTIVATION_GROUP:
        return x.float()
    groups = x.float().reshape(*x.shape[:-1], k // ACTIVATION_GROUP, ACTIVATION_GROUP)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (groups / safe).round().clamp(-127, 127)
    return (q * scale).reshape(x.shape)


def quant_matmul(
    x: torch.Tensor,
    w: QuantizedTensor,
    bias: torch.Tensor | None = None,
    activations: str = "int8",
) -> torch.Tensor:
    """y = x W^T (+ bias): x [..., K] fp32/bf16, W [N, K] quantized; y [..., N] in x's dtype.
    activations "int8": x is rounded to int8 per group of 32 first (as the native kernel
    multiplies); "fp32": x as it is."""
    if activations not in ACTIVATION_MODES:
        raise ValueError(f"activations {activations!r}: expected one of {ACTIVATION_MODES}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {w.shape[1]} columns")
    xf = _round_activations(x) if activations == "int8" else x.float()
    out = F.linear(xf, dequantize(w), None if bias is None else bias.float())
    return out.to(x.dtype)
