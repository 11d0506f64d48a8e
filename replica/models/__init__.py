"""Decoder model implementations and the registry that picks one for a checkpoint."""

from replica.models.registry import (
    MODEL_REGISTRY,
    UnsupportedArchitectureError,
    resolve_model_class,
    supported_architectures,
)

__all__ = [
    "MODEL_REGISTRY",
    "UnsupportedArchitectureError",
    "resolve_model_class",
    "supported_architectures",
]
