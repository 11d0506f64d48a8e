"""Which layers attend through a sliding window, read from a HF config as transformers reads it
for each family: Mistral, Mixtral, Phi-3 and Qwen3-MoE window every layer, Qwen2 the layers from
max_window_layers on (with use_sliding_window), Gemma 2 every other layer, Gemma 3 five of every
six; a config's own `layer_types` list wins where the family honours it (Qwen3, SmolLM3). A
window on a family whose layout is not known here is an error, never ignored."""

from __future__ import annotations

from typing import Any

from torch import nn

SLIDING = "sliding_attention"
FULL = "full_attention"
# architecture -> layers per repeat of its pattern (the last of each repeat attends fully)
_PATTERNS = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
# families whose every layer takes the config's window (transformers passes it to each layer)
_EVERY_LAYER = {"MixtralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM"}


def _architecture(hf_config: Any) -> str:
    return (getattr(hf_config, "architectures", None) or [""])[0]


def layer_types(hf_config: Any) -> list[str]:
    """SLIDING or FULL for each layer."""
    n = int(hf_config.num_hidden_layers)
    arch = _architecture(hf_config)
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return [FULL] * n
    if arch == "MistralForCausalLM":  # transformers' Mistral ignores layer_types
        return [SLIDING] * n
    if arch == "Qwen2ForCausalLM" and not getattr(hf_config, "use_sliding_window", False):
        return [FULL] * n
    types = getattr(hf_config, "layer_types", None)
    if types is None and arch in _EVERY_LAYER:
        return [SLIDING] * n
    if types is None:
        if arch == "Qwen2ForCausalLM":
            first = int(getattr(hf_config, "max_window_layers", 28))
            types = [SLIDING if i >= first else FULL for i in range(n)]
        elif arch in _PATTERNS:
            pattern = int(
                getattr(hf_config, "sliding_window_pattern", None)
                or getattr(hf_config, "_sliding_window_pattern", None)
                or _PATTERNS[arch]
            )
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        else:
            raise ValueError(
                f"sliding_window={window} on architecture {arch!r}, whose layers' windows are "
                "not known here (no layer_types in its config); windowed families: Mistral, "
                "Mixtral, Phi-3, Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3"
            )
    types = list(types)[:n]
    unknown = sorted({t for t in types if t not in (SLIDING, FULL)})
    if unknown or len(types) != n:
        raise ValueError(
            f"layer_types {types!r} is not supported: expected {n} entries, each "
            f"{SLIDING!r} or {FULL!r}"
        )
    return types


def layer_windows(hf_config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention)."""
    window = getattr(hf_config, "sliding_window", None)
    return [int(window) if t == SLIDING else None for t in layer_types(hf_config)]


def all_layers_window(hf_config: Any) -> int | None:
    """The window when every layer has the same one (the KV manager may then free the blocks
    all of them have left behind); None when some layer attends fully."""
    windows = set(layer_windows(hf_config))
    return windows.pop() if len(windows) == 1 else None


def apply_layer_windows(model: nn.Module, hf_config: Any) -> None:
    """Give each Attention layer of `model` (in layer order) its window from the config."""
    from replica.layers.attention.layer import attention_layers

    layers = attention_layers(model)
    windows = layer_windows(hf_config)
    if len(layers) != len(windows):
        raise ValueError(f"{len(layers)} attention layers but {len(windows)} layer windows")
    for layer, window in zip(layers, windows):
        layer.set_sliding_window(window)
