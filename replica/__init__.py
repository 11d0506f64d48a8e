"""Everything that runs on one replica's devices; importable without Ray."""

from replica.config import EngineConfig
from replica.request import RequestOutput, SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from replica.engine import LLM

        return LLM
    raise AttributeError(name)
