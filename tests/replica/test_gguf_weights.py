"""GGUF tensors into the model (replica/quant/gguf_weights.py, quant/weights.py, loader.py):
the K-quant packers of the tiny builder against gguf's de-quantizer, our header reader against
gguf's, names and llama.cpp's per-architecture fixes against transformers' reading of the same
file, quantized weights held without float copies (mixed types in one fused projection, float
tensors as Parameters), vocabulary sharding of a quantized embedding, and the errors."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from replica.layers.linear import TensorParallel
from replica.loader import CheckpointError, load_model
from replica.quant import kernels
from replica.quant.formats import QType, QuantizedTensor
from replica.quant.gguf_meta import file_stamp
from replica.quant.weights import QuantizedWeight, WeightPlan, set_activations, weight_bytes
from replica.tiny_models_gguf import _permute, quantize
from tests.replica.quant_helpers import gguf_path, hf_gguf_model, tiny_gguf_dir


def full_weight(weight) -> torch.Tensor:
    """A layer's weight as fp32 [rows, cols], de-quantized segment by segment."""
    if not isinstance(weight, QuantizedWeight):
        return weight.detach().float()
    out = torch.zeros(weight.shape)
    for offset, seg in weight.segments:
        rows = kernels.dequantize(seg) if isinstance(seg, QuantizedTensor) else seg.float()
        out[offset : offset + rows.shape[0]] = rows
    return out


@pytest.fixture(scope="module")
def llama_dir():
    return tiny_gguf_dir("llama")


@pytest.fixture(scope="module")
def llama(llama_dir):
    model = load_model(llama_dir)
    set_activations(model, "fp32")
    return model


# -- the tiny builder's K-quant packers --------------------------------------------------------
@pytest.mark.parametrize(("qtype", "levels"), [("Q4_K", 15), ("Q5_K", 31), ("Q6_K", 63)])
def test_k_quant_packers_round_trip_through_ggufs_dequantizer(qtype, levels):
    """Our packed blocks, read by gguf's reference de-quantizer, give back the values within
    about one quantization step of their sub-block (a wrong layout would be off by far more);
    zero blocks, all-positive and all-negative sub-blocks included."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 0.1, (6, 512)).astype(np.float32)
    x[0, :256] = 0.0
    x[1, :40] += 0.5
    x[2, 300:] -= 0.5
    data, ggml = quantize(x, qtype)
    assert ggml == GGMLQuantizationType[qtype]
    y = quants.dequantize(data, ggml).reshape(x.shape)
    assert np.all(y[0, :256] == 0.0)
    err = np.abs(y - x).reshape(-1, 32).max(axis=1)
    spread = np.maximum(np.abs(x).reshape(-1, 32).max(axis=1), 1e-6)
    step = 2 * spread / levels  # the widest a sub-block's step can be
    assert np.all(err <= 1.5 * step), (err / step).max()
    assert np.corrcoef(x.ravel(), y.ravel())[0, 1] > {15: 0.99, 31: 0.998, 63: 0.999}[levels]


# -- the header reader ------------------------------------------------------------------------
def test_header_reader_matches_ggufs_own_reader(tmp_path):
    import gguf

    from replica.quant.gguf_weights import read_gguf

    path = tmp_path / "x.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 3)
    writer.add_float32("llama.rope.freq_base", 5e5)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "<|x|>"] * 40)
    writer.add_array("tokenizer.ggml.token_type", [1, 2, 3] * 50)
    writer.add_string("tokenizer.chat_template", "{{ x }}")
    writer.add_uint32("general.alignment", 64)
    a = np.arange(96, dtype=np.float32).reshape(3, 32)
    writer.add_tensor("a.weight", a)
    q, ggml = quantize(np.ones((2, 64), np.float32), "Q4_0")
    writer.add_tensor("b.weight", q, raw_dtype=ggml)
    writer.add_tensor("c.weight", np.ones(5, np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = read_gguf(path, arrays=True)
    theirs = gguf.GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.fields[key] == field.contents(), key
    for info, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert (info.name, info.tensor_type) == (tensor.name, int(tensor.tensor_type))
        assert np.array_equal(ours.data(info), tensor.data), info.name
    # without arrays: long arrays skipped, scalars and the tensors the same
    lean = read_gguf(path)
    assert lean.fields["tokenizer.ggml.tokens"] is None
    assert lean.fields["llama.block_count"] == 3
    assert [t.offset for t in lean.tensors] == [t.offset for t in ours.tensors]


# -- names and fixes, against transformers' reading of the same file -----------------------------
def test_unpermute_undoes_llama_cpp_permutation_on_quantized_rows():
    from replica.quant.formats import quantize_q8_0
    from replica.quant.gguf_weights import unpermute_rows

    w = torch.randn(48, 64)
    permuted = torch.from_numpy(_permute(w.numpy(), 3))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rows(permuted, 3), w)
    q = quantize_q8_0(permuted)
    back = unpermute_rows(q, 3)
    assert torch.equal(back.dequantize(), quantize_q8_0(w).dequantize())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "phi3"])
def test_every_weight_matches_transformers_reading_of_the_gguf(arch):
    """Our model's weights (de-quantized) equal transformers' de-quantized ones tensor for
    tensor: the name maps, llama's query/key un-permutation on quantized rows, Gemma's norm
    offset (checked through our 1 + w, which transformers adds in its forward) and Qwen3-MoE's
    stacked experts (split per expert, quantized as they are; its Q8_0 router read as float)."""
    sidecar = tiny_gguf_dir(arch)
    ours = load_model(sidecar)
    theirs = dict(hf_gguf_model(sidecar).named_parameters())
    gemma = arch == "gemma3"
    checked = 0
    for name, param in theirs.items():
        if name == "lm_head.weight" and ours.tie_word_embeddings:
            continue
        if ".mlp.experts." in name:  # transformers stacks them: [experts, rows, cols]
            _check_experts(ours, name, param)
            checked += 1
            continue
        module_name, _, kind = name.rpartition(".")
        mine, start = _our_part(ours, module_name, kind)
        rows = param.shape[0]
        got = full_weight(mine)[start : start + rows]
        want = param.detach().float()
        if gemma and "norm" in module_name:
            want = want + 1.0  # our Gemma norm loads 1 + w
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
        checked += 1
    assert checked == len(theirs)  # named_parameters lists a tied lm_head once


def _check_experts(model, name: str, stacked: torch.Tensor) -> None:
    block = model.get_submodule(name.split(".experts.")[0])
    for e, expert in enumerate(block.experts):
        ours = expert.gate_up_proj if name.endswith("gate_up_proj") else expert.down_proj
        torch.testing.assert_close(full_weight(ours.weight), stacked[e].float(), rtol=0, atol=1e-6)


def _our_part(model, module_name: str, kind: str):
    """Our weight holding HF's `module_name`.`kind`, and the first row of its part."""
    fused = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    fused |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    parent, _, leaf = module_name.rpartition(".")
    if leaf not in fused:
        return getattr(model.get_submodule(module_name), kind), 0
    ours, part = fused[leaf]
    layer = model.get_submodule(f"{parent}.{ours}")
    if ours == "qkv_proj":
        start = {"q": 0, "k": layer.q_size, "v": layer.q_size + layer.kv_size}[part]
    else:
        start = part * layer.output_sizes[0]
    return getattr(layer, kind), start


# -- quantized weights in the model --------------------------------------------------------------
def test_mixed_types_in_one_fused_projection_keep_their_own_segments(llama):
    """A QKV of three types is three segments; one of a single type is one (joined); quantized
    and float parts side by side; an all-float gate_up is a Parameter again (and packable);
    every matmul equals F.linear by the de-quantized weight."""
    layers = llama.model.layers
    qkv0 = layers[0].self_attn.qkv_proj
    assert [(o, t) for (o, _), t in zip(qkv0.weight.segments, qkv0.weight.qtypes)] == [
        (0, "Q8_0"),
        (qkv0.q_size, "Q4_0"),
        (qkv0.q_size + qkv0.kv_size, "Q4_1"),
    ]
    assert layers[1].self_attn.qkv_proj.weight.qtypes == ["Q8_0"]
    assert layers[2].self_attn.qkv_proj.weight.qtypes == ["Q4_1", "float32"]
    assert isinstance(layers[1].mlp.gate_up_proj.weight, torch.nn.Parameter)
    assert isinstance(layers[1].self_attn.o_proj.weight, torch.nn.Parameter)
    assert [layers[i].mlp.down_proj.weight.qtypes for i in range(3)] == [
        ["Q4_K"],
        ["Q6_K"],
        ["Q5_K"],
    ]
    x = torch.randn(5, 64)
    for layer in (qkv0, layers[2].self_attn.qkv_proj, layers[0].mlp.gate_up_proj):
        want = torch.nn.functional.linear(x, full_weight(layer.weight))
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_quantized_weights_hold_no_float_copy(llama):
    """No Parameter stands in for a quantized weight: the float parameters are the norms, the
    float linears of layer 1 and layer 2's float v part; the resident bytes say so."""
    floats = {n: tuple(p.shape) for n, p in llama.named_parameters()}
    assert all("norm" in n or ".layers.1." in n for n in floats), sorted(floats)
    qweights = {
        id(w): w
        for m in llama.modules()
        if isinstance(w := m.__dict__.get("weight"), QuantizedWeight)
    }.values()
    # QKV x3, gate_up x2 (layer 1's is float), down x3, o_proj x2 (same), the tied embedding
    assert len(qweights) == 3 + 2 + 3 + 2 + 1
    sizes = weight_bytes(llama)
    assert sizes["quantized_bytes"] == sum(w.quantized_bytes for w in qweights)
    assert sizes["quantized_weights"] == len(qweights)
    embed = llama.model.embed_tokens.weight
    assert isinstance(embed, QuantizedWeight) and llama.lm_head.weight is embed
    assert embed.quantized_bytes == 49152 * 64 // 32 * 34  # Q8_0, once for both uses
    fp32_bytes = 4 * sum(int(np.prod(w.shape)) for w in qweights)
    assert sizes["total_bytes"] < 0.4 * fp32_bytes  # Q8_0 is 34/128 of fp32, Q4s less


def test_quantized_embedding_looks_up_rows_and_shards_the_vocabulary(llama_dir, llama):
    """A lookup de-quantizes just the rows asked for; under tp=2 each rank's embedding and LM
    head hold their half of the vocabulary's rows (no process group needed to load)."""
    embed = llama.model.embed_tokens
    table = full_weight(embed.weight)
    ids = torch.tensor([[3, 49151], [0, 1234]])
    assert torch.equal(embed(ids), table[ids])
    half = 49152 // 2
    for rank in range(2):
        shard = load_model(llama_dir, tp=TensorParallel(rank, 2))
        weight = shard.model.embed_tokens.weight
        assert isinstance(weight, QuantizedWeight) and weight.shape == (half, 64)
        torch.testing.assert_close(full_weight(weight), table[rank * half : (rank + 1) * half])
        local = torch.tensor([0, 7, half - 1])
        torch.testing.assert_close(
            shard.model.embed_tokens.lookup(local), table[local + rank * half]
        )
        set_activations(shard, "fp32")
        h = torch.randn(2, 64)
        want = h @ table[rank * half : (rank + 1) * half].T
        torch.testing.assert_close(shard.lm_head.matmul(h, None), want, rtol=1e-5, atol=1e-5)


def test_row_parallel_shards_of_whole_blocks_load(llama_dir, llama):
    """tp=2 gives each rank 256 of down_proj's 512 input columns: one whole Q4_K/Q5_K/Q6_K
    block per row, sliced out of the blocks as they are."""
    for rank in range(2):
        shard = load_model(llama_dir, tp=TensorParallel(rank, 2))
        for i in range(3):
            mine = shard.model.layers[i].mlp.down_proj.weight
            full = full_weight(llama.model.layers[i].mlp.down_proj.weight)
            assert mine.shape == (64, 256)
            torch.testing.assert_close(full_weight(mine), full[:, rank * 256 : (rank + 1) * 256])


def test_gguf_with_int8_quantizes_the_float_tensors_and_keeps_the_quantized_ones(llama_dir):
    model = load_model(llama_dir, quantization="int8")
    layers = model.model.layers
    assert layers[0].self_attn.qkv_proj.weight.qtypes == ["Q8_0", "Q4_0", "Q4_1"]
    assert layers[1].mlp.gate_up_proj.weight.qtypes == ["Q8_0"]  # F32 + F16 -> one Q8_0
    assert layers[1].self_attn.o_proj.weight.qtypes == ["Q8_0"]
    assert layers[2].self_attn.qkv_proj.weight.qtypes == ["Q4_1", "Q8_0"]
    assert layers[1].mlp.down_proj.weight.qtypes == ["Q6_K"]


def test_int8_keeps_layers_whose_in_features_are_not_whole_groups_float(caplog):
    from replica.quant.weights import building, new_weight

    plan = WeightPlan(gguf=False, quantize_float=True, tied_embeddings=False)
    with caplog.at_level(logging.INFO, logger="replica.quant.weights"), building(plan):
        kept = new_weight((8, 48), None, "linear")
        taken = new_weight((8, 64), None, "linear")
        embed = new_weight((100, 64), None, "embedding")  # untied: a lookup table, float
        head = new_weight((100, 64), None, "lm_head")
    assert isinstance(kept, torch.nn.Parameter) and isinstance(embed, torch.nn.Parameter)
    assert isinstance(taken, QuantizedWeight) and isinstance(head, QuantizedWeight)
    assert "stay float" in caplog.text and "(8, 48)" in caplog.text


# -- errors --------------------------------------------------------------------------------------
def _gguf_variant(tmp_path, name, **kwargs):
    from replica.tiny_models_gguf import build_tiny_gguf, write_sidecar

    kwargs.setdefault("tokenizer_gguf", False)
    path = build_tiny_gguf(tmp_path / f"{name}.gguf", "llama", seed=5, **kwargs)
    return write_sidecar(path, tmp_path / name)


@pytest.mark.parametrize(
    ("arch", "tp", "layer", "qtype", "block", "width", "cols"),
    [
        # Qwen3's o_proj (256 wide, Q4_K) at tp=2: half a block per rank
        ("qwen3", 2, "model.layers.0.self_attn.o_proj.weight", "Q4_K", 256, 128, 256),
        # the llama's o_proj (64 wide, Q4_0) at tp=4: 16 of a block's 32 columns
        ("llama", 4, "model.layers.0.self_attn.o_proj.weight", "Q4_0", 32, 16, 64),
    ],
)
def test_a_shard_that_would_split_a_block_names_layer_block_and_width(
    arch, tp, layer, qtype, block, width, cols
):
    with pytest.raises(CheckpointError) as err:
        load_model(tiny_gguf_dir(arch), tp=TensorParallel(0, tp))
    message = str(err.value)
    assert layer in message and qtype in message and f"tensor_parallel_size={tp}" in message
    assert f"blocks of {block} columns" in message
    assert f"{width} of its {cols} input columns" in message


def test_unsupported_tensor_type_names_tensor_type_and_the_supported_ones(tmp_path):
    sidecar = _gguf_variant(tmp_path, "mxfp4", qtypes={"blk.1.ffn_up.weight": "MXFP4"})
    with pytest.raises(CheckpointError) as err:
        load_model(sidecar)
    message = str(err.value)
    assert "blk.1.ffn_up.weight" in message and "MXFP4" in message
    assert "supported" in message and "Q4_K" in message and "Q8_0" in message


def test_missing_tensor_is_named(tmp_path):
    sidecar = _gguf_variant(tmp_path, "missing", drop=("blk.1.ffn_gate.weight",))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors.*model\.layers\.1\.mlp\.gate_proj"):
        load_model(sidecar)


def test_a_file_that_is_not_gguf_or_is_missing_is_refused(tmp_path, llama_dir):
    sidecar = tmp_path / "bad"
    sidecar.mkdir()
    (sidecar / "config.json").write_text((llama_dir / "config.json").read_text())
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOTGGUF" + bytes(100))
    record = {"gguf_file": str(junk)} | file_stamp(junk.stat())
    (sidecar / "gguf.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="not a valid GGUF file"):
        load_model(sidecar)
    junk.unlink()
    with pytest.raises(CheckpointError, match="no longer exists"):
        load_model(sidecar)


def test_gemma_norm_stored_quantized_is_refused(tmp_path):
    from replica.quant.gguf_weights import GGUFCheckpoint, GGUFWeightError

    checkpoint = GGUFCheckpoint(gguf_path(tiny_gguf_dir("gemma3")))
    q = QuantizedTensor(QType.Q8_0, (1, 32), torch.zeros(1, 34, dtype=torch.uint8))
    with pytest.raises(GGUFWeightError, match="blk.0.attn_norm.weight.*Q8_0.*1 \\+ w"):
        checkpoint._fixed("blk.0.attn_norm.weight", q)


# -- the tiny builder's tokenizer -----------------------------------------------------------------
def test_tiny_gguf_carries_the_smollm2_tokenizer_transformers_reads(tmp_path):
    """The tiny file's tokenizer metadata is the installed SmolLM2 GGUF's: transformers builds
    the tokenizer from it (vocabulary 49152, chat template) and the model beside it."""
    from transformers import AutoTokenizer

    from replica.tiny_models_gguf import build_tiny_gguf

    path = build_tiny_gguf(tmp_path / "tok.gguf", "llama", seed=9, num_hidden_layers=1)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert len(tokenizer) == 49152 and tokenizer.chat_template
    text = "Prefix caching hashes full blocks of tokens, 12 345!"
    ids = tokenizer(text)["input_ids"]
    assert 1 < len(ids) < len(text) and tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.eos_token == "<|im_end|>"
