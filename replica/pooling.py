"""Embeddings from the final hidden states (after the model's last norm) of pooling requests
(EngineRequest.pooling): the sums of the rows each step contributes (`pool_rows`, over the
runner's StepBatch.pool_spans), and the vector a request's sum ends as (`finish_embedding`). Also what a checkpoint declares
about its embeddings (`embedding_info`): its width and Matryoshka dimensions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from replica.errors import RequestRejected
from replica.request import PoolingRequest

if TYPE_CHECKING:  # the scheduler imports this module; torch comes with the runner
    import torch

POOLING_KINDS = ("last", "mean")


def pool_rows(hidden: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Per span (first row, rows) of the step's flat hidden states: the float32 sum of its
    rows on the CPU (one row for "last", a prefill chunk's rows for "mean")."""
    import torch

    sums = [hidden[first : first + n].float().sum(0) for first, n in spans]
    return list(torch.stack(sums).cpu().unbind(0))


def finish_embedding(pooled: torch.Tensor, pooling: PoolingRequest, num_rows: int) -> list[float]:
    """The request's embedding from its pooled sum over `num_rows` rows: the mean ("mean"),
    cut to `dimensions`, then L2-normalized when asked."""
    vector = pooled / num_rows if pooling.kind == "mean" else pooled
    if pooling.dimensions is not None:
        vector = vector[: pooling.dimensions]
    if pooling.normalize:
        vector = vector / vector.norm().clamp_min(1e-12)
    return vector.tolist()


def embedding_info(hf_config: Any) -> dict:
    """What the ingress checks an embeddings request against: the hidden size (an embedding's
    full width) and the Matryoshka dimensions the checkpoint declares (config.json
    `matryoshka_dimensions`, or `is_matryoshka: true` for any width up to the hidden size;
    None: `dimensions` is refused)."""
    hidden = int(hf_config.hidden_size)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        matryoshka: list[int] | bool | None = sorted({int(d) for d in dims if 0 < int(d) <= hidden})
    elif getattr(hf_config, "is_matryoshka", False):
        matryoshka = True
    else:
        matryoshka = None
    return {"hidden_size": hidden, "matryoshka": matryoshka}


def check_pooling(pooling: PoolingRequest) -> None:
    """RequestRejected for a PoolingRequest no engine can serve (the ingress checks
    `dimensions` against the model: router/embeddings.py)."""
    if pooling.kind not in POOLING_KINDS:
        raise RequestRejected(
            f"pooling kind must be one of {list(POOLING_KINDS)}, got {pooling.kind!r}", "pooling"
        )
    if pooling.dimensions is not None and pooling.dimensions < 1:
        raise RequestRejected(f"dimensions must be >= 1, got {pooling.dimensions}", "dimensions")
