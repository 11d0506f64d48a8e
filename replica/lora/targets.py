"""Which linear layers of a loaded model an adapter may adapt, under their Hugging Face names:
per decoder layer, q/k/v_proj (row ranges of our fused qkv_proj), o_proj, gate/up_proj (of
gate_up_proj), down_proj, and a checkpoint's own fused names (Phi-3's qkv_proj, gate_up_proj).
Mixture-of-experts MLPs have no adaptable module (their layers list the attention only)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from replica.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


@dataclass(frozen=True)
class Target:
    """One HF module of one decoder layer: our `linear`, and the parts of its output the
    module's lora_B rows fill, in order: (shard id for the linear's weight_loader, rows)."""

    linear: nn.Module
    parts: tuple[tuple[str | int | None, int], ...]  # shard id None: the whole output
    in_features: int

    @property
    def out_features(self) -> int:
        return sum(rows for _, rows in self.parts)

    @property
    def row_parallel(self) -> bool:
        return isinstance(self.linear, RowParallelLinear)


def _qkv_rows(linear: QKVParallelLinear) -> dict[str, int]:
    d = linear.head_dim
    kv = linear.total_num_kv_heads * d
    return {"q": linear.total_num_heads * d, "k": kv, "v": kv}


def _layer_targets(layer: nn.Module, model: nn.Module) -> dict[str, Target]:
    shard_ids = {part: shard for _, part, shard in getattr(model, "stacked_params_mapping", ())}
    fused_names = getattr(model, "fused_checkpoint_tensors", {})
    found: dict[str, Target] = {}
    for parent_name in ("self_attn", "mlp"):
        parent = getattr(layer, parent_name, None)
        if parent is None:
            continue
        for child_name, child in parent.named_children():
            if isinstance(child, QKVParallelLinear):
                rows = _qkv_rows(child)
            elif isinstance(child, MergedColumnParallelLinear):
                rows = dict(enumerate(child.output_sizes))
            elif isinstance(child, RowParallelLinear | ColumnParallelLinear):
                found[child_name] = Target(child, ((None, child.output_size),), child.input_size)
                continue
            else:
                continue
            if child_name in fused_names:  # a checkpoint that stores it fused (Phi-3)
                parts = tuple(
                    (shard_ids[p], rows[shard_ids[p]]) for p, _ in fused_names[child_name]
                )
                found[child_name] = Target(child, parts, child.input_size)
                continue
            for part, shard in shard_ids.items():  # HF's names of this linear's parts
                if shard in rows:
                    found[part] = Target(child, ((shard, rows[shard]),), child.input_size)
    return found


class LoRATargets:
    """The adaptable modules of `model` (a LlamaForCausalLM-like model: model.layers[i] with
    self_attn and mlp), layer by layer; shapes are the full (unsharded) ones."""

    def __init__(self, model: nn.Module) -> None:
        layers = model.model.layers
        self.layers: list[dict[str, Target]] = [_layer_targets(layer, model) for layer in layers]
        self.num_layers = len(self.layers)
        names: dict[str, None] = {}
        for found in self.layers:
            names.update(dict.fromkeys(found))
        self.module_names: tuple[str, ...] = tuple(names)

    def target(self, layer: int, module: str) -> Target | None:
        if not 0 <= layer < self.num_layers:
            return None
        return self.layers[layer].get(module)

    def shape_of(self, layer: int, module: str) -> tuple[int, int] | None:
        """(out, in) features of the module's full weight, or None when the model lacks it."""
        found = self.target(layer, module)
        return None if found is None else (found.out_features, found.in_features)

    def modules_of(self, layer: int) -> tuple[str, ...]:
        return tuple(self.layers[layer]) if 0 <= layer < self.num_layers else ()
