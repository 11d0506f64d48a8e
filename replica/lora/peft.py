"""Reading a LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors or
.bin) and checking it against the model it will run on: what it targets, its rank and scaling,
and its A/B tensors per (layer, Hugging Face module name), on CPU in the adapter's dtype."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from replica.errors import LoRAError
from replica.lora.targets import LoRATargets

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT's key of one LoRA factor: base_model.model.model.layers.N.<module path>.lora_A.weight
_KEY = re.compile(r"layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
# adapter_config.json fields that change the computation in ways we do not implement; each
# must be absent or hold one of the listed "off" values
_REFUSED_FIELDS = {
    "use_dora": (False, None),
    "modules_to_save": (None, [], ()),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "lora_bias": (False, None),
    "layer_replication": (None, []),
    "target_parameters": (None, []),
    "megatron_config": (None,),
}


@dataclass
class PeftAdapter:
    """One adapter as read from disk: `factors[(layer, module)] = (A [r, in], B [out, r])`,
    `module` being the Hugging Face name (q_proj, ..., or Phi-3's fused qkv_proj)."""

    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    target_modules: tuple[str, ...]  # the HF module names it has factors for
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    def info(self, name: str) -> dict:
        return {"name": name, "rank": self.rank, "target_modules": list(self.target_modules)}


def read_adapter(name: str, path: str, targets: LoRATargets, max_rank: int) -> PeftAdapter:
    """The adapter at `path`, checked against the model (`targets`) and `max_rank`; LoRAError
    names what is wrong (missing files, refused features, rank, modules the model lacks)."""
    directory = Path(path)
    if not directory.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: directory {path!r} does not exist")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {path!r} is not a PEFT adapter (no {CONFIG_FILE})")
    weights = next((directory / f for f in WEIGHT_FILES if (directory / f).is_file()), None)
    if weights is None:
        raise LoRAError(
            f"LoRA adapter {name!r}: {path!r} is not a PEFT adapter (no "
            f"{' or '.join(WEIGHT_FILES)})"
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {config_path}: {exc}") from None
    rank, scaling = _check_config(name, config, targets, max_rank)
    factors = _read_factors(name, weights, targets, rank)
    modules = tuple(sorted({module for _, module in factors}))
    return PeftAdapter(str(directory), rank, scaling, modules, factors)


def _check_config(
    name: str, config: dict, targets: LoRATargets, max_rank: int
) -> tuple[int, float]:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    for key, off in _REFUSED_FIELDS.items():
        value = config.get(key)
        if value not in off:
            raise LoRAError(
                f"LoRA adapter {name!r}: {key}={value!r} is not supported (only plain LoRA: "
                "no DoRA, modules_to_save, rank/alpha patterns, LoRA bias or layer replication)"
            )
    bias = config.get("bias", "none")
    if bias != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias={bias!r} is not supported, only 'none'")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"LoRA adapter {name!r}: r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise LoRAError(
            f"LoRA adapter {name!r}: rank {rank} exceeds max_lora_rank={max_rank} of this replica"
        )
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    wanted = config.get("target_modules")
    if isinstance(wanted, list | tuple):
        experts = [m for m in wanted if "expert" in m]
        if experts:
            raise LoRAError(
                f"LoRA adapter {name!r}: targets mixture-of-experts modules {experts}; "
                "LoRA on experts is not supported"
            )
        lacking = sorted(set(wanted) - set(targets.module_names))
        if lacking:
            raise LoRAError(
                f"LoRA adapter {name!r}: targets modules {lacking} that the model does not "
                f"have; it has {list(targets.module_names)}"
            )
    return rank, scaling


def _load_tensors(name: str, weights: Path) -> dict[str, torch.Tensor]:
    try:
        if weights.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(weights), device="cpu")
        return torch.load(str(weights), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {weights}: {exc}") from None


def _read_factors(
    name: str, weights: Path, targets: LoRATargets, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unknown, experts = [], []
    for key, tensor in _load_tensors(name, weights).items():
        match = _KEY.search(key)
        if match is None:
            unknown.append(key)
            continue
        layer, module_path, which = int(match[1]), match[2], match[3]
        if "expert" in module_path:
            experts.append(key)
            continue
        halves.setdefault((layer, module_path), {})[which] = tensor
    if experts:
        raise LoRAError(
            f"LoRA adapter {name!r}: has factors for mixture-of-experts modules ({experts[0]}, "
            f"... {len(experts)} tensors); LoRA on experts is not supported"
        )
    if unknown:
        raise LoRAError(
            f"LoRA adapter {name!r}: has factors for modules the model's layers lack or we do "
            f"not adapt ({', '.join(unknown[:4])}); adaptable modules: "
            f"{list(targets.module_names)}"
        )
    if not halves:
        raise LoRAError(f"LoRA adapter {name!r}: {weights} holds no lora_A/lora_B tensors")
    factors = {}
    for (layer, module_path), pair in halves.items():
        module = module_path.rsplit(".", 1)[-1]
        where = f"layers.{layer}.{module_path}"
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: {where} has lora_{set(pair).pop()} only")
        shape = targets.shape_of(layer, module)
        if shape is None:
            lacking = "layer" if layer >= targets.num_layers else "module"
            raise LoRAError(
                f"LoRA adapter {name!r}: targets {where}, a {lacking} the model does not have "
                f"({targets.num_layers} layers; adaptable modules in layer {layer}: "
                f"{list(targets.modules_of(layer))})"
            )
        a, b = pair["A"], pair["B"]
        out_features, in_features = shape
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRAError(
                f"LoRA adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; rank {rank} on this model needs "
                f"({rank}, {in_features}) and ({out_features}, {rank})"
            )
        factors[(layer, module)] = (a, b)
    return factors
