"""Tiny random GGUF checkpoints (llama, qwen2, qwen3, qwen3moe, phi3, gemma3 architectures) with a chosen block
format per tensor, written the way llama.cpp's converter writes them (query/key rows permuted
for llama, Gemma norms stored as 1 + w, hyperparameters in the metadata), with the real SmolLM2
tokenizer's metadata (vocabulary 49152) copied from the installed default model's GGUF so that
transformers loads the file too: the reference the quantized engine is tested against.

Q8_0, Q4_0 and Q4_1 are quantized by the gguf package; the K-quants (Q4_K, Q5_K, Q6_K), which it
only de-quantizes, by the small packers here (plain min/max scales, not llama.cpp's searched
ones: the layout is what matters, and tests check it against gguf's de-quantizer)."""

from __future__ import annotations

import fnmatch
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

QK_K = 256
TINY_GGUF_FIELDS: dict[str, dict[str, Any]] = {
    # hidden 64 keeps the LM head over 49152 tokens cheap; intermediate 512 lets down_proj be a
    # K-quant whose 256-column blocks still split whole across two tensor-parallel ranks
    "llama": dict(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=512,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        tie_word_embeddings=False,
    ),
    # transformers reads no head_dim from a qwen3 GGUF: its default, 128
    "qwen3": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        intermediate_size=256,
        tie_word_embeddings=True,
    ),
    "gemma3": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=256,
        sliding_window=16,
        tie_word_embeddings=True,
    ),
    # q, k, v and gate, up stored fused (attn_qkv, ffn_up)
    "phi3": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        tie_word_embeddings=False,
    ),
    # transformers reads neither head_dim nor the experts' width from a qwen3moe GGUF: its
    # defaults, 128 and 768 (three 256-blocks: the experts' down_proj can be a K-quant)
    "qwen3moe": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        intermediate_size=256,
        moe_intermediate_size=768,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
}
_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
# HF module of a decoder layer -> GGUF part (blk.N.<part>)
_PARTS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # the experts' router
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections
    "mlp.gate_up_proj": "ffn_up",
}
_GEMMA_PARTS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


# -- K-quant packers ------------------------------------------------------------------------
def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block [n, 8] into GGML's 12-byte K-quant layout."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def _affine_k(blocks: np.ndarray, levels: int):
    """Per block of 256 [n, 256]: sub-block (32) scales and mins as 6-bit multiples of the
    block's fp16 d and dmin, and the quants q in [0, levels] with x ~ d*sc*q - dmin*m."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = sub.max(axis=-1)
    scale = (hi - lo) / levels
    mins = -lo
    d = _f16(scale.max(axis=-1) / 63.0)
    dmin = _f16(mins.max(axis=-1) / 63.0)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63)
    m = np.clip(np.round(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63)
    eff = (df * sc)[..., None]
    off = (dminf * m)[..., None]
    q = np.divide(sub + off, eff, out=np.zeros_like(sub), where=eff > 0)
    q = np.clip(np.round(q), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> uint8 [rows, cols / 256 * 144] GGML Q4_K blocks."""
    rows = x.shape[0]
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    d, dmin, sc, m, q = _affine_k(blocks, 15)
    q = q.reshape(-1, 4, 2, 32)  # chunks of 64: low nibbles sub-block 2c, high 2c+1
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
         _pack_scale_min(sc, m), qs], axis=1,
    )  # fmt: skip
    return out.reshape(rows, -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> uint8 [rows, cols / 256 * 176] GGML Q5_K blocks."""
    rows = x.shape[0]
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    d, dmin, sc, m, q = _affine_k(blocks, 31)  # q [n, 8, 32]
    low = (q & 0xF).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4) & 1  # sub-block s's fifth bit is bit s of qh[l]
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for s in range(8):
        qh |= (high[:, s] << s).astype(np.uint8)
    out = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
         _pack_scale_min(sc, m), qh, qs], axis=1,
    )  # fmt: skip
    return out.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> uint8 [rows, cols / 256 * 210] GGML Q6_K blocks (16 int8 scales of
    16 elements each, one fp16 d, 6-bit quants offset by 32)."""
    rows = x.shape[0]
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    n = blocks.shape[0]
    groups = blocks.reshape(n, 16, 16)
    scale = np.abs(groups).max(axis=-1) / 31.0
    d = _f16(scale.max(axis=-1) / 127.0)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 127)
    eff = (df * sc)[..., None]
    q = np.divide(groups, eff, out=np.zeros_like(groups), where=eff > 0)
    q = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    # half h, group j of 32: ql byte h*64 + (j % 2)*32 + l, nibble j // 2; qh byte h*32 + l,
    # bits 2j, 2j+1
    ql = np.zeros((n, 2, 64), dtype=np.uint8)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for j in range(4):
        low, high = q[:, :, j] & 0xF, q[:, :, j] >> 4
        half = slice((j % 2) * 32, (j % 2) * 32 + 32)
        ql[:, :, half] |= low << (4 * (j // 2))
        qh |= high << (2 * j)
    out = np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
         d.view(np.uint8).reshape(-1, 2)], axis=1,
    )  # fmt: skip
    return out.reshape(rows, -1)


_K_PACKERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(x: np.ndarray, qtype: str) -> tuple[np.ndarray, Any]:
    """(array for GGUFWriter.add_tensor, its GGML type) of a float array in `qtype`."""
    from gguf import GGMLQuantizationType, quants

    ggml = GGMLQuantizationType[qtype]
    if qtype == "F32":
        return x.astype(np.float32), ggml
    if qtype == "F16":
        return x.astype(np.float16), ggml
    if qtype in _K_PACKERS:
        return _K_PACKERS[qtype](x), ggml
    return quants.quantize(x.astype(np.float32), ggml), ggml


# -- the file -------------------------------------------------------------------------------
def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's per-head permutation of query/key rows (for its rotary)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _gguf_name(hf_name: str, arch: str) -> str | None:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    parts = _PARTS | (_GEMMA_PARTS if arch == "gemma3" else {})
    rest = hf_name.removeprefix("model.layers.")
    layer, _, rest = rest.partition(".")
    module, _, kind = rest.rpartition(".")
    if module not in parts:
        return None
    return f"blk.{layer}.{parts[module]}.{kind}"


@functools.cache
def _tokenizer_fields(source: Path) -> list[tuple[str, Any, int, int | None]]:
    """(key, value, value type, item type) of every tokenizer.* field of `source`."""
    from replica.quant.gguf_weights import read_gguf

    file = read_gguf(source, arrays=True)
    return [
        (key, value, *file.field_types[key])
        for key, value in file.fields.items()
        if key.startswith("tokenizer.")
    ]


def _copy_tokenizer(writer, source: Path) -> None:
    """Every tokenizer.* key of `source` (the installed SmolLM2 GGUF) into `writer`."""
    from gguf import GGUFValueType

    for key, value, vtype, item in _tokenizer_fields(source):
        sub = None if item is None else GGUFValueType(item)
        writer.add_key_value(key, value, GGUFValueType(vtype), sub_type=sub)


def _hf_model(arch: str, seed: int, fields: dict[str, Any]):
    import torch
    import transformers

    config_name, model_name = _HF_CLASSES[arch]
    config = getattr(transformers, config_name)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                # Gemma's norms scale by 1 + w: w around 0.2; the others' around 1
                centre = 0.0 if arch == "gemma3" else 1.0
                param.copy_(centre + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    return model


def build_tiny_gguf(
    path: str | Path,
    arch: str = "llama",
    qtypes: dict[str, str] | None = None,
    default_qtype: str = "Q8_0",
    seed: int = 0,
    tokenizer_gguf: str | Path | None | bool = None,
    drop: tuple[str, ...] = (),
    **overrides: Any,
) -> Path:
    """Write a random tiny `arch` model as GGUF at `path`. qtypes: GGUF tensor name patterns
    (fnmatch, first match wins) -> GGML type name (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, F16,
    F32, or any other type gguf can quantize to); other 2-D tensors take default_qtype, 1-D
    ones (norms, biases) F32. tokenizer_gguf: the GGUF whose tokenizer metadata is copied
    (None: the installed SmolLM2's; False: none, which transformers then reads in
    milliseconds instead of seconds). drop: names of tensors to leave out."""
    import gguf

    from replica.default_model import find_gguf_file

    fields = {
        "vocab_size": 49152,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        **TINY_GGUF_FIELDS[arch],
        **overrides,
    }
    if arch in ("qwen2", "phi3"):
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    model = _hf_model(arch, seed, fields)
    heads, kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
    head_dim = fields["head_dim"]
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    prefix = arch
    writer.add_string("general.name", f"tiny-{arch}")
    writer.add_uint32(f"{prefix}.block_count", fields["num_hidden_layers"])
    writer.add_uint32(f"{prefix}.context_length", fields["max_position_embeddings"])
    writer.add_uint32(f"{prefix}.embedding_length", fields["hidden_size"])
    writer.add_uint32(f"{prefix}.feed_forward_length", fields["intermediate_size"])
    writer.add_uint32(f"{prefix}.attention.head_count", heads)
    writer.add_uint32(f"{prefix}.attention.head_count_kv", kv_heads)
    writer.add_uint32(f"{prefix}.attention.key_length", head_dim)
    writer.add_uint32(f"{prefix}.attention.value_length", head_dim)
    writer.add_uint32(f"{prefix}.rope.dimension_count", head_dim)
    writer.add_float32(f"{prefix}.rope.freq_base", float(fields["rope_theta"]))
    writer.add_float32(f"{prefix}.attention.layer_norm_rms_epsilon", float(fields["rms_norm_eps"]))
    writer.add_uint32(f"{prefix}.vocab_size", fields["vocab_size"])
    if arch == "gemma3":
        writer.add_uint32(f"{prefix}.attention.sliding_window", fields["sliding_window"])
    if arch == "qwen3moe":
        writer.add_uint32(f"{prefix}.expert_count", fields["num_experts"])
        writer.add_uint32(f"{prefix}.expert_used_count", fields["num_experts_per_tok"])
        writer.add_uint32(f"{prefix}.expert_feed_forward_length", fields["moe_intermediate_size"])
    writer.add_uint32("general.file_type", 7)  # mostly Q8_0; per tensor below
    writer.add_uint32("general.quantization_version", 2)
    if tokenizer_gguf is not False:
        _copy_tokenizer(writer, Path(tokenizer_gguf) if tokenizer_gguf else find_gguf_file())
    patterns = list((qtypes or {}).items())
    tensors = []
    for hf_name, param in model.state_dict().items():
        w = param.detach().float().numpy()
        if hf_name.endswith(".mlp.experts.gate_up_proj"):  # [experts, 2 * inter, hidden]
            layer = hf_name.split(".")[2]
            inter = w.shape[1] // 2
            tensors.append((f"blk.{layer}.ffn_gate_exps.weight", w[:, :inter]))
            tensors.append((f"blk.{layer}.ffn_up_exps.weight", w[:, inter:]))
        elif hf_name.endswith(".mlp.experts.down_proj"):  # [experts, hidden, inter]
            tensors.append((f"blk.{hf_name.split('.')[2]}.ffn_down_exps.weight", w))
        else:
            tensors.append((_gguf_name(hf_name, arch), w))
    for name, w in tensors:
        if name is None or (name == "output.weight" and fields["tie_word_embeddings"]):
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in drop):
            continue
        if arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
            w = _permute(w, heads if ".attn_q." in name else kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0
        qtype = next((q for pat, q in patterns if fnmatch.fnmatchcase(name, pat)), None)
        qtype = qtype or (default_qtype if w.ndim >= 2 else "F32")
        # stacked experts: each expert's rows quantized as rows of one [experts * rows] matrix
        data, ggml = quantize(w.reshape(-1, w.shape[-1]), qtype)
        writer.add_tensor(name, data.reshape(*w.shape[:-1], data.shape[-1]), raw_dtype=ggml)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_sidecar(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """A model directory for a GGUF file as the tests need one: config.json (transformers' own
    reading of the file's metadata, so both sides run one config), generation_config.json and
    gguf.json naming the file. (Serving builds sidecars with replica/quant/gguf_meta.py.)"""
    from transformers import AutoConfig

    from replica.quant.gguf_meta import MODEL_TYPE_ARCHITECTURES, SIDECAR_RECORD, file_stamp

    gguf_path, out = Path(gguf_path).resolve(), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    raw = config.to_dict()
    raw.pop("quantization_config", None)
    raw["architectures"] = [MODEL_TYPE_ARCHITECTURES[raw["model_type"]]]
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    eos = raw.get("eos_token_id", 2)
    generation = {"bos_token_id": raw.get("bos_token_id"), "eos_token_id": eos}
    (out / "generation_config.json").write_text(json.dumps(generation))
    record = {"gguf_file": str(gguf_path)} | file_stamp(gguf_path.stat())
    (out / SIDECAR_RECORD).write_text(json.dumps(record))
    return out
