"""Checks, before any worker starts, that a tensor-parallel size fits the model and the devices
or placement group the replica has."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch


def check_tensor_parallel_config(hf_config: Any, tp: int) -> None:
    """Raise ValueError naming the value that cannot be split `tp` ways."""
    from replica.models.llama import num_kv_heads_of

    heads = int(hf_config.num_attention_heads)
    if heads % tp:
        raise ValueError(
            f"num_attention_heads ({heads}) is not divisible by tensor_parallel_size ({tp})"
        )
    kv_heads = num_kv_heads_of(hf_config)
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"num_key_value_heads ({kv_heads}) and tensor_parallel_size ({tp}): one must be a "
            "multiple of the other (KV heads are split, or replicated when there are fewer)"
        )
    inter = int(hf_config.intermediate_size)
    if inter % tp:
        raise ValueError(
            f"intermediate_size ({inter}) is not divisible by tensor_parallel_size ({tp})"
        )


def _check_local_devices(device: str, tp: int) -> None:
    if device != "cuda":
        return  # CPU ranks share the host's cores; torch threads are split between them
    visible = torch.cuda.device_count()
    if tp > visible:
        raise ValueError(
            f"tensor_parallel_size={tp} needs {tp} GPUs but {visible} are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )


def _check_bundles(placement_group: Any, device: str, tp: int) -> None:
    bundles = placement_group.bundle_specs
    if len(bundles) < tp:
        raise ValueError(
            f"tensor_parallel_size={tp} needs a placement group of {tp} bundles (one per rank); "
            f"the replica's has {len(bundles)}"
        )
    if device == "cuda":
        short = [i for i in range(tp) if bundles[i].get("GPU", 0) < 1]
        if short:
            raise ValueError(
                f"tensor_parallel_size={tp} on CUDA needs one GPU per bundle; bundles {short} of "
                f"the replica's placement group have none ({bundles})"
            )


def current_placement_group() -> Any:
    """The placement group this process runs in when it is a Ray worker; None otherwise
    (checked without importing or starting Ray)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    from ray.util import get_current_placement_group

    return get_current_placement_group()
