"""Load a Hugging Face model directory (config.json + safetensors, single file or sharded with
an index) into our model; every parameter copies its own shard, read lazily with get_slice.
A directory whose gguf.json names a GGUF file (replica/quant/gguf_meta.py) loads that file's
tensors instead, quantized ones kept in their blocks (replica/quant/weights.py); with
quantization="int8" float weights are quantized to Q8_0 as they load."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from replica.layers.linear import TensorParallel, WeightShapeError, loaded_shape, narrow_loaded
from replica.models.registry import resolve_model_class
from replica.quant.formats import BLOCK, QuantFormatError, QuantizedTensor
from replica.quant.weights import (
    QuantizedWeight,
    WeightPlan,
    building,
    finalize_weights,
    named_quantized_weights,
)

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
# tensors some checkpoints carry that the model recomputes
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The model directory or its weights cannot be loaded; the message says why."""


def check_model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir).expanduser()
    if not path.exists():
        raise CheckpointError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{str(path)!r} has no config.json; expected a Hugging Face model directory"
        )
    return path


# transformers' defaults (v5) for the config.json fields the models read, by architecture: a
# field config.json leaves out takes these, as transformers' config classes give it
# (tests/replica/test_loader.py checks them against AutoConfig). Reading config.json ourselves keeps
# transformers' config classes out of the replica: importing one pulls in torch.distributed's
# tensor package and more, ~3 s of a replica's start on a 2-core host.
_COMMON_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    # no rope_theta: a config may carry it in rope_parameters (rotary.rope_parameters reads
    # both, 10000 when neither has it)
}
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"intermediate_size": 11008, "max_position_embeddings": 2048},
    "MistralForCausalLM": {
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
    },
    "Qwen2ForCausalLM": {
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
    },
    "Phi3ForCausalLM": {
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "sliding_window": None,
    },
    "SmolLM3ForCausalLM": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "rope_theta": 2000000.0,  # read after rope_parameters' own (rotary.rope_parameters)
        "no_rope_layer_interval": 4,
    },
    "Qwen3ForCausalLM": {
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
    },
    "Qwen3MoeForCausalLM": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        # under transformers' own name for it, so a config.json's num_experts (Qwen's name)
        # or num_local_experts (transformers' save) wins: models/moe.py num_experts_of
        "num_local_experts": 128,
        "num_hidden_layers": 24,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "MixtralForCausalLM": {
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        # theta 1e6 where config.json names none (a rope_theta or rope_parameters there wins)
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "OlmoeForCausalLM": {
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
    },
}


def load_hf_config(model_dir: str | Path) -> SimpleNamespace:
    """The checkpoint's config.json, checked to be an architecture we run, with the defaults
    transformers would give the fields it leaves out."""
    path = check_model_dir(model_dir)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'} is not valid JSON: {exc}") from exc
    resolve_model_class(raw.get("architectures"))
    defaults = _COMMON_DEFAULTS | ARCH_DEFAULTS.get(raw["architectures"][0], {})
    return SimpleNamespace(**(defaults | raw))


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json, else every *.safetensors."""
    path = Path(model_dir)
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{str(path)!r} has no *.safetensors weights (only safetensors checkpoints are "
            "supported; convert .bin/.pt weights with transformers' save_pretrained)"
        )
    return files


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    hf_config: Any,
    tp: TensorParallel,
    device: torch.device | str,
    dtype: torch.dtype,
    plan: WeightPlan | None = None,
) -> nn.Module:
    """The model with uninitialised parameters of this rank's shard shapes; with a plan, the
    weights it takes are empty QuantizedWeights instead (replica/quant/weights.py)."""
    cls = resolve_model_class(getattr(hf_config, "architectures", None))
    with torch.device(device), _default_dtype(dtype), building(plan):
        model = cls(hf_config, tp)
    return model.eval()


QUANTIZATIONS = ("none", "int8")


def load_model(
    model_dir: str | Path,
    hf_config: Any | None = None,
    tp: TensorParallel | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
) -> nn.Module:
    """Build the model for `model_dir` and load this rank's weights into it: from its
    safetensors, or from the GGUF file its gguf.json names (quantized tensors stay quantized).
    quantization="int8": every float linear weight (the LM head too, and a tied embedding)
    whose in-features are whole groups of 32 is quantized to Q8_0 as it loads; a GGUF's
    quantized tensors stay as they are."""
    from replica.quant.gguf_meta import GGUFError, gguf_file_of

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: expected one of {QUANTIZATIONS}")
    path = check_model_dir(model_dir)
    hf_config = hf_config if hf_config is not None else load_hf_config(path)
    try:
        gguf_file = gguf_file_of(path)
    except GGUFError as exc:
        raise CheckpointError(str(exc)) from None
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    int8 = quantization == "int8"
    plan = WeightPlan(gguf_file is not None, int8, tied) if gguf_file or int8 else None
    tp = tp or TensorParallel()
    if gguf_file is None:
        files = safetensors_files(path)
        model = build_model(hf_config, tp, device, dtype, plan)
        load_weights(model, files)
    else:
        if not gguf_file.is_file():
            raise CheckpointError(f"{path / 'gguf.json'} names {gguf_file}, which does not exist")
        model = build_model(hf_config, tp, device, dtype, plan)
        load_gguf_weights(model, gguf_file)
    if plan is not None:
        finalize_weights(model)
        _log_quantized(model, gguf_file, quantization)
    return model


def _log_quantized(model: nn.Module, gguf_file: Path | None, quantization: str) -> None:
    types: dict[str, int] = {}
    for _, weight in named_quantized_weights(model):
        for name in weight.qtypes:
            types[name] = types.get(name, 0) + 1
    logger.info(
        "weights from %s%s: %d quantized weights, segments by type %s",
        gguf_file.name if gguf_file else "safetensors",
        " with quantization=int8" if quantization == "int8" else "",
        sum(1 for _ in named_quantized_weights(model)),
        dict(sorted(types.items())),
    )


def load_gguf_weights(model: nn.Module, gguf_file: Path) -> None:
    """Copy each tensor of a GGUF file into its parameter or quantized weight."""
    from replica.quant.gguf_weights import GGUFCheckpoint, GGUFWeightError

    try:
        checkpoint = GGUFCheckpoint(gguf_file, getattr(model, "hf_config", None))
        opened = ((name, _ready(t), gguf_file.name) for name, t in checkpoint.tensors())
        _load_tensors(model, opened, gguf_file.parent)
    except GGUFWeightError as exc:
        raise CheckpointError(str(exc)) from exc


def _ready(tensor: Any) -> Callable[[], Any]:
    return lambda: tensor


def _checkpoint_parts(model: nn.Module, hf_name: str, loaded: Any) -> list[tuple[str, Any]]:
    """A checkpoint tensor as the per-projection tensors the model loads: a fused one (Phi-3's
    qkv_proj, gate_up_proj; `fused_checkpoint_tensors` of the model) split by rows into its
    parts under their unfused names, every other tensor as it is."""
    for fused, parts in getattr(model, "fused_checkpoint_tensors", {}).items():
        if f".{fused}." not in hf_name:
            continue
        shape = loaded_shape(loaded)
        rows = sum(size for _, size in parts)
        if shape[0] != rows:
            raise WeightShapeError((rows, *shape[1:]), shape)
        out, offset = [], 0
        for part, size in parts:
            out.append(
                (hf_name.replace(f".{fused}.", f".{part}."), narrow_loaded(loaded, 0, offset, size))
            )
            offset += size
        return out
    return [(hf_name, loaded)]


def _to_model_name(model: nn.Module, hf_name: str) -> tuple[str, Any]:
    # a family whose checkpoint names a module differently (Mixtral's block_sparse_moe)
    for theirs, ours in getattr(model, "checkpoint_renames", ()):
        hf_name = hf_name.replace(f".{theirs}.", f".{ours}.")
    for fused, part, shard_id in getattr(model, "stacked_params_mapping", ()):
        if f".{part}." in hf_name:
            return hf_name.replace(f".{part}.", f".{fused}."), shard_id
    return hf_name, None


def named_weights(model: nn.Module) -> dict[str, Any]:
    """Every parameter and quantized weight by name (each once: a tied LM head's weight is the
    embedding's)."""
    params: dict[str, Any] = dict(model.named_parameters())
    for name, weight in named_quantized_weights(model):
        params.setdefault(name, weight)
    return params


def _expected_hf_names(model: nn.Module) -> set[str]:
    names = set()
    mapping = getattr(model, "stacked_params_mapping", ())
    # named_parameters drops duplicates, so a tied lm_head is not expected on its own
    for name in named_weights(model):
        parts = {
            name.replace(f".{fused}.", f".{part}.")
            for fused, part, _ in mapping
            if f".{fused}." in name
        }
        names.update(parts or {name})
    for theirs, ours in getattr(model, "checkpoint_renames", ()):
        names = {name.replace(f".{ours}.", f".{theirs}.") for name in names}
    return names


def load_weights(model: nn.Module, files: list[Path]) -> None:
    """Copy each checkpoint tensor into its parameter (each parameter takes its own shard)."""
    _load_tensors(model, _safetensors_tensors(files), files[0].parent)


def _safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, Callable[[], Any], str]]:
    """(name, opener of its lazy slice, file) of every tensor of the files."""
    from safetensors import safe_open

    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error type for a bad header
            raise CheckpointError(
                f"cannot read {file}: corrupt or not a safetensors file ({exc})"
            ) from exc
        with handle as f:
            for hf_name in f.keys():
                yield hf_name, (lambda f=f, n=hf_name: f.get_slice(n)), str(file)


class _Dequantized:
    """A quantized checkpoint tensor read as float, for a parameter that stays float (a norm,
    a router): the lazy-slice protocol of linear.py's loaders."""

    def __init__(self, tensor: QuantizedTensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return self.tensor.get_shape()

    def __getitem__(self, index) -> torch.Tensor:
        from replica.quant import kernels

        rows = self.tensor[index[:1] if isinstance(index, tuple) else index]
        out = kernels.dequantize(rows)
        if isinstance(index, tuple) and len(index) > 1:
            out = out[(slice(None), *index[1:])]
        return out


def _load_tensors(
    model: nn.Module, tensors: Iterable[tuple[str, Callable[[], Any], str]], where: Path
) -> None:
    """Copy each (name, opener, source) tensor into its parameter; raise on what is missing."""
    params = named_weights(model)
    tied = bool(getattr(model, "tie_word_embeddings", False))
    expected = _expected_hf_names(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for hf_name, open_tensor, source in tensors:
        if hf_name.endswith(_IGNORED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
            continue
        label = Path(source).name
        try:
            for part_name, tensor in _checkpoint_parts(model, hf_name, open_tensor()):
                name, shard_id = _to_model_name(model, part_name)
                param = params.get(name)
                if param is None:
                    unexpected.append(part_name)
                    continue
                if isinstance(param, QuantizedWeight):
                    param.name = name
                elif isinstance(tensor, QuantizedTensor):
                    tensor = _Dequantized(tensor)
                try:
                    if shard_id is None:
                        param.weight_loader(param, tensor)
                    else:
                        param.weight_loader(param, tensor, shard_id)
                except QuantFormatError as exc:
                    raise CheckpointError(_quant_error(model, part_name, tensor, exc)) from exc
                loaded.add(part_name)
        except WeightShapeError as exc:
            raise CheckpointError(
                f"{label}: tensor {hf_name!r} has shape {list(exc.got)} but the model "
                f"expects {list(exc.expected)}"
            ) from exc
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {hf_name!r} from {source}: {exc}") from exc
    if unexpected:
        logger.warning(
            "ignoring %d checkpoint tensors the model does not use, e.g. %s",
            len(unexpected),
            unexpected[:3],
        )
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise CheckpointError(
            f"checkpoint in {where} lacks {len(missing)} tensors the model needs: {shown}"
        )


def _quant_error(model: nn.Module, name: str, tensor: Any, exc: QuantFormatError) -> str:
    """What went wrong loading a quantized tensor; a tensor-parallel shard that would cut its
    blocks is said as such."""
    tp = getattr(model, "tp", None)
    if isinstance(tensor, QuantizedTensor) and tp is not None and tp.size > 1:
        elems = BLOCK[tensor.qtype][0]
        cols = tensor.shape[1]
        if cols % tp.size == 0 and (cols // tp.size) % elems:
            return (
                f"cannot shard {name!r} ({tensor.qtype.name}, {list(tensor.shape)}) across "
                f"tensor_parallel_size={tp.size}: each rank would hold {cols // tp.size} of its "
                f"{cols} input columns, which cuts its {tensor.qtype.name} blocks of {elems} "
                f"columns (a shard must be whole blocks; {cols // elems} blocks do not split "
                f"{tp.size} ways)"
            )
    return f"cannot load {name!r}: {exc}"
