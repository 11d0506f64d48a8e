"""Checkpoint loading: sharded and single-file safetensors, clear errors for every way a model
directory can be wrong, tensor-parallel shard math of each weight_loader, the default model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replica.config import EngineConfig
from replica.layers.attention import TorchSDPAMetadata
from replica.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from replica.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallel,
)
from replica.layers.rotary import RotaryEmbedding
from replica.loader import CheckpointError, load_model
from replica.models import UnsupportedArchitectureError, supported_architectures


@pytest.fixture
def llama_copy(tiny_llama_dir, tmp_path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, out)
    return out


def _logits(model, ids: list[int]) -> torch.Tensor:
    kv_heads = model.model.layers[0].self_attn.attn.num_kv_heads
    caches = [
        (torch.zeros(8, 8, kv_heads, 16), torch.zeros(8, 8, kv_heads, 16))
        for _ in range(model.num_layers)
    ]
    meta, positions = TorchSDPAMetadata.build([0], [len(ids)], [list(range(8))], 8)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), positions, caches, meta))


def test_sharded_checkpoint_with_index_loads_the_same_weights(tiny_qwen2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32)
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    ids = [5, 77, 300, 2, 18, 420]
    torch.testing.assert_close(
        _logits(load_model(sharded), ids), _logits(load_model(tiny_qwen2_dir), ids)
    )


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    (tmp_path / "weights").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_model(tmp_path / "weights")


def test_no_config_json(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_model(llama_copy)


def test_config_json_is_not_json(llama_copy):
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(llama_copy)


def test_no_safetensors(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights"):
        load_model(llama_copy)


def test_corrupt_safetensors(llama_copy):
    (llama_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(CheckpointError, match="corrupt or not a safetensors file"):
        load_model(llama_copy)


def test_index_naming_a_missing_shard(llama_copy):
    index = {
        "metadata": {},
        "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"},
    }
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_model(llama_copy)


def test_shape_mismatch_names_the_tensor_and_both_shapes(llama_copy):
    path = llama_copy / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = torch.zeros(48, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        load_model(llama_copy)
    message = str(info.value)
    assert name in message and "[48, 64]" in message and "[32, 64]" in message


def test_missing_tensors_are_named(llama_copy):
    path = llama_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    del tensors["lm_head.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks 2 tensors") as info:
        load_model(llama_copy)
    assert "model.layers.0.mlp.up_proj.weight" in str(info.value)
    assert "lm_head.weight" in str(info.value)


def test_extra_tensors_are_ignored(llama_copy):
    path = llama_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    tensors["some.unused.tensor"] = torch.zeros(3)
    save_file(tensors, path, metadata={"format": "pt"})
    load_model(llama_copy)


def test_unsupported_architecture_names_it_and_the_supported_ones(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError) as info:
        load_model(llama_copy)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(name in message for name in supported_architectures())
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"} <= set(
        supported_architectures()
    )


def test_unsupported_rope_scaling_is_a_clear_error():
    with pytest.raises(ValueError, match="'dynamic' is not supported; supported: default"):
        RotaryEmbedding(16, 64, 10000.0, {"rope_type": "dynamic", "factor": 4.0})


def test_linear_rope_scaling_divides_positions():
    plain = RotaryEmbedding(16, 64, 10000.0)
    scaled = RotaryEmbedding(16, 64, 10000.0, {"type": "linear", "factor": 2.0})
    torch.testing.assert_close(scaled.cos[10], plain.cos[5])
    torch.testing.assert_close(scaled.sin[30], plain.sin[15])


# -- tensor-parallel shard math ---------------------------------------------------------------
def _shards(make, full: torch.Tensor, size: int, *shard_id) -> list[torch.Tensor]:
    out = []
    for rank in range(size):
        layer = make(TensorParallel(rank, size))
        layer.weight.weight_loader(layer.weight, full, *shard_id)
        out.append(layer.weight.detach().clone())
    return out


@pytest.mark.parametrize("size", [1, 2, 4])
def test_row_parallel_shards_split_input_columns(size):
    full = torch.randn(6, 8)
    parts = _shards(lambda tp: RowParallelLinear(8, 6, False, tp), full, size)
    torch.testing.assert_close(torch.cat(parts, dim=1), full)
    # partial products summed (the all_reduce) equal the full product
    x = torch.randn(3, 8)
    partial = sum(x[:, r * 8 // size : (r + 1) * 8 // size] @ p.T for r, p in enumerate(parts))
    torch.testing.assert_close(partial, x @ full.T)


@pytest.mark.parametrize("size", [1, 2])
def test_merged_gate_up_shards_hold_their_slice_of_each_part(size):
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    ranks = [
        MergedColumnParallelLinear(4, [8, 8], False, TensorParallel(r, size)) for r in range(size)
    ]
    for layer in ranks:
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
    n = 8 // size
    for r, layer in enumerate(ranks):
        torch.testing.assert_close(layer.weight[:n], gate[r * n : (r + 1) * n])
        torch.testing.assert_close(layer.weight[n:], up[r * n : (r + 1) * n])


@pytest.mark.parametrize(("size", "kv_heads"), [(1, 2), (2, 2), (4, 2), (4, 1)])
def test_qkv_shards_split_heads_and_replicate_scarce_kv_heads(size, kv_heads):
    d, heads, hidden = 4, 4, 8
    q = torch.randn(heads * d, hidden)
    k, v = torch.randn(kv_heads * d, hidden), torch.randn(kv_heads * d, hidden)
    for rank in range(size):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, True, TensorParallel(rank, size))
        for shard_id, full in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, full, shard_id)
            layer.bias.weight_loader(layer.bias, full[:, 0].clone(), shard_id)
        q_heads = heads // size
        kv_per_rank = max(1, kv_heads // size)
        assert layer.num_kv_heads == kv_per_rank
        # query head h attends KV head h // (heads // kv_heads): this rank must hold those
        first_kv = (rank * q_heads) // (heads // kv_heads)
        kv_rows = slice(first_kv * d, (first_kv + kv_per_rank) * d)
        got_q, got_k, got_v = layer.weight.split([q_heads * d, kv_per_rank * d, kv_per_rank * d])
        torch.testing.assert_close(got_q, q[rank * q_heads * d : (rank + 1) * q_heads * d])
        torch.testing.assert_close(got_k, k[kv_rows])
        torch.testing.assert_close(got_v, v[kv_rows])
        torch.testing.assert_close(layer.bias[: q_heads * d], got_q[:, 0])


@pytest.mark.parametrize("size", [1, 3, 4])
def test_vocab_parallel_rows_are_padded_with_zeros(size):
    full = torch.randn(10, 4)
    for cls in (VocabParallelEmbedding, ParallelLMHead):
        parts = _shards(lambda tp, cls=cls: cls(10, 4, tp), full, size)
        stacked = torch.cat(parts)
        assert stacked.shape[0] == -(-10 // size) * size
        torch.testing.assert_close(stacked[:10], full)
        assert not stacked[10:].any()


def test_weight_loader_rejects_a_wrong_full_shape():
    layer = RowParallelLinear(8, 6, False, TensorParallel(0, 2))
    with pytest.raises(ValueError, match=r"expected shape \(6, 8\), checkpoint has \(6, 7\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(6, 7))


def test_indivisible_heads_are_a_clear_error():
    with pytest.raises(ValueError, match=r"number of attention heads \(9\) is not divisible"):
        QKVParallelLinear(576, 64, 9, 3, False, TensorParallel(0, 2))


# -- the default model ------------------------------------------------------------------------
def test_default_model_is_converted_once_with_tokenizer_and_generation_config(
    dequantized_default_model_dir,
):
    """The de-quantized fp32 copy the parity tests compare with transformers."""
    from transformers import AutoConfig, AutoTokenizer

    from replica.default_model import dequantized_default_model_dir as convert

    default_model_dir = dequantized_default_model_dir
    weights = default_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert convert() == default_model_dir
    assert weights.stat().st_mtime_ns == before  # idempotent: no second conversion
    config = AutoConfig.from_pretrained(str(default_model_dir))
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert (config.hidden_size // config.num_attention_heads, config.vocab_size) == (64, 49152)
    assert config.tie_word_embeddings and not hasattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id


# -- config.json and tokenizer read without transformers' config classes -----------------------
READ_FIELDS = [
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "tie_word_embeddings", "attention_bias", "mlp_bias", "head_dim",
]  # fmt: skip


def _as_read(config) -> dict:
    """What the model code reads of a config, as it reads it (replica/models/llama.py,
    replica/layers/rotary.py, replica/runner.py)."""
    from replica.layers.rotary import rope_parameters
    from replica.models.llama import head_dim_of, num_kv_heads_of
    from replica.runner import model_max_len

    theta, scaling = rope_parameters(config)
    if scaling is not None:  # transformers folds rope_theta into rope_parameters
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        scaling = None if scaling in ({}, {"rope_type": "default"}) else scaling
    return {
        "head_dim": head_dim_of(config),
        "kv_heads": num_kv_heads_of(config),
        "max_len": model_max_len(config),
        "theta": theta,
        "scaling": scaling,
        "eps": float(config.rms_norm_eps),
        "tied": bool(getattr(config, "tie_word_embeddings", False)),
        "act": getattr(config, "hidden_act", "silu"),
        "attention_bias": bool(getattr(config, "attention_bias", False)),
        "mlp_bias": bool(getattr(config, "mlp_bias", False)),
        **{f: getattr(config, f) for f in READ_FIELDS[1:6] + ["architectures"]},
    }


MINIMAL = {  # a config.json that leaves every optional field to the defaults
    "LlamaForCausalLM": {"model_type": "llama"},
    "MistralForCausalLM": {"model_type": "mistral"},
    "Qwen2ForCausalLM": {"model_type": "qwen2"},
}


@pytest.mark.parametrize("variant", ["tiny", "minimal", "qwen2-window-off", "mistral-no-window"])
@pytest.mark.parametrize("arch", sorted(MINIMAL))
def test_config_json_reads_as_transformers_config_classes_do(
    arch, variant, tmp_path, tiny_llama_dir, tiny_qwen2_dir, tiny_mistral_dir
):
    from transformers import AutoConfig

    from replica.loader import load_hf_config

    tiny = {"LlamaForCausalLM": tiny_llama_dir, "Qwen2ForCausalLM": tiny_qwen2_dir,
            "MistralForCausalLM": tiny_mistral_dir}[arch]  # fmt: skip
    raw = json.loads((tiny / "config.json").read_text())
    if variant == "minimal":
        raw = {"architectures": [arch], **MINIMAL[arch]}
    elif variant == "qwen2-window-off":
        raw |= {"sliding_window": 64, "use_sliding_window": False}
    elif variant == "mistral-no-window":
        raw |= {"sliding_window": None}
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    ours, theirs = load_hf_config(out), AutoConfig.from_pretrained(str(out))
    assert _as_read(ours) == _as_read(theirs)


def test_default_model_config_reads_as_transformers_does(default_model_dir):
    from transformers import AutoConfig

    from replica.loader import load_hf_config

    ours = load_hf_config(default_model_dir)
    assert _as_read(ours) == _as_read(AutoConfig.from_pretrained(str(default_model_dir)))


@pytest.mark.parametrize("which", ["default", "tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_tokenizer_is_the_one_autotokenizer_loads(
    which, request, tiny_llama_dir, tiny_qwen2_dir, tiny_mistral_dir
):
    from transformers import AutoTokenizer

    from replica.tokenizer import generic_tokenizer_class, load_tokenizer

    model_dir = {"tiny-llama": tiny_llama_dir, "tiny-qwen2": tiny_qwen2_dir,
                 "tiny-mistral": tiny_mistral_dir}.get(which)  # fmt: skip
    if model_dir is None:
        model_dir = request.getfixturevalue("default_model_dir")
    ours, theirs = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    if which in ("default", "tiny-llama"):
        assert generic_tokenizer_class(model_dir) is not None  # the direct path was taken
    assert type(ours) is type(theirs)
    texts = ["The quick brown fox", "  spaces\tand\nnewlines ", "émigré 日本語 🙂", ""]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text)
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.eos_token_id == theirs.eos_token_id and ours.bos_token_id == theirs.bos_token_id
    # what an engine core reads from the files instead of loading the tokenizer
    from replica.tokenizer import declared_eos_token_id

    assert declared_eos_token_id(model_dir) == theirs.eos_token_id
    if theirs.chat_template:
        chat = [{"role": "user", "content": "hi"}]
        assert ours.apply_chat_template(chat, add_generation_prompt=True) == (
            theirs.apply_chat_template(chat, add_generation_prompt=True)
        )


def test_an_eos_token_the_files_do_not_settle_is_left_to_the_tokenizer(llama_copy):
    """The engine core loads the tokenizer after all when its eos id cannot be read from the
    files, and its eos ids are the loaded tokenizer's then."""
    from replica.engine import Engine
    from replica.tokenizer import LazyTokenizer, declared_eos_token_id, load_tokenizer

    config_path = llama_copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = "<not-a-token-of-this-vocabulary>"
    config_path.write_text(json.dumps(config))
    with pytest.raises(LookupError, match="not in tokenizer.json"):
        declared_eos_token_id(llama_copy)
    engine_config = EngineConfig(model=str(llama_copy), device="cpu", num_kv_blocks=16)
    engine = Engine(engine_config, detokenize=False)
    assert not isinstance(engine._tokenizer, LazyTokenizer)
    assert engine.tokenizer.eos_token_id == load_tokenizer(llama_copy).eos_token_id
    assert engine.structured.tokenizer is engine.tokenizer
    engine.shutdown()


def test_an_engine_that_does_not_detokenize_loads_its_tokenizer_at_the_first_grammar(
    tiny_llama_dir,
):
    from replica.engine import Engine
    from replica.request import SamplingParams, StructuredOutput
    from replica.tokenizer import LazyTokenizer, load_tokenizer

    engine_config = EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=16)
    engine = Engine(engine_config, detokenize=False)
    lazy = engine._tokenizer
    assert isinstance(lazy, LazyTokenizer) and not lazy.loaded
    assert load_tokenizer(tiny_llama_dir).eos_token_id in engine.eos_token_ids
    engine.compile_grammar(
        SamplingParams(structured=StructuredOutput(kind="choice", spec='["yes", "no"]'))
    )
    assert lazy.loaded
    engine.shutdown()
