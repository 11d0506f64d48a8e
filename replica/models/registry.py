"""Model classes by the `architectures[0]` name in a HF config.json."""

from __future__ import annotations

from torch import nn

from replica.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from replica.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from replica.models.moe import MixtralForCausalLM, OlmoeForCausalLM
from replica.models.phi3 import Phi3ForCausalLM
from replica.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM
from replica.models.smollm3 import SmolLM3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no implementation here."""


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for config.json's `architectures`; a clear error names what is supported."""
    if not architectures:
        raise UnsupportedArchitectureError(
            "config.json has no `architectures` entry; supported: "
            + ", ".join(supported_architectures())
        )
    name = architectures[0]
    cls = MODEL_REGISTRY.get(name)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"model architecture {name!r} is not supported; supported: "
            + ", ".join(supported_architectures())
        )
    return cls
