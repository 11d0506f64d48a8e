"""The tensors of a GGUF checkpoint under our (Hugging Face) parameter names, quantized ones as
QuantizedTensor (the file's blocks, memory-mapped: a rank's loader copies only the rows and
whole-block columns it keeps) and float ones (F32, F16, BF16) as torch tensors.

GGUF names a tensor `blk.N.<part>.weight` (llama.cpp's convention); each architecture's table
below says which HF module a part is. What llama.cpp's converter changed on the way in is undone
here: Llama's (and Mistral's, which llama.cpp files as llama) query and key rows are permuted per
head for its rotary layout, so they are permuted back (rows are whole in every block format, so
this works on quantized rows as they are); Gemma's norm weights are stored as 1 + w, so 1 is
subtracted (on float tensors; a quantized one would need its values changed: an error).
Mixture-of-experts files stack every expert's projection in one [experts, rows, cols] tensor;
each expert's slice is its own tensor here."""

from __future__ import annotations

import logging
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replica.quant.formats import BLOCK, FLOAT_TYPES, QType, QuantFormatError, QuantizedTensor

logger = logging.getLogger(__name__)

# the GGUF `general.architecture` values we read (gguf_meta.check_servable refuses others
# before any metadata directory is made), and what their tensors are called here
SUPPORTED_ARCHITECTURES = ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen3", "qwen3moe")
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<part> -> model.layers.N.<module> (".weight" / ".bias" kept)
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: fused, split by the loader's fused tensors
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the experts' router
}
_GEMMA_BLOCK = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_BLOCK = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate and up fused in one tensor
    "gemma2": _GEMMA_BLOCK,
    "gemma3": _GEMMA_BLOCK,
}
# stacked experts: blk.N.<part> -> model.layers.N.mlp.experts.E.<projection>
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_MIXTRAL_EXPERTS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
# recomputed from config.json (rope scaling factors, rotary tables)
_IGNORED = re.compile(
    r"^(rope_freqs|rope_factors_long|rope_factors_short)\.weight$|\.attn_rot_embd"
)
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_PERMUTED_ARCHS = ("llama",)
_PLUS_ONE_NORM_ARCHS = ("gemma2", "gemma3")


class GGUFWeightError(ValueError):
    """A GGUF tensor cannot be served as it is; the message names the tensor and why."""


# GGUF value types (gguf.GGUFValueType): scalar struct formats; 8 string, 9 array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the row length (ne0) first
    tensor_type: int
    offset: int  # from the start of the file


@dataclass
class GGUFFile:
    """A GGUF file's metadata and tensor table, and the file memory-mapped copy-on-write
    (writable numpy views, nothing copied until written, and nothing is)."""

    path: Path
    fields: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    mmap: np.memmap
    # each field's GGUF value type, and for an array its items' type
    field_types: dict[str, tuple[int, int | None]]

    def data(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as numpy: float types in their dtype, shaped [.., rows, cols];
        block types uint8 [.., rows, row_bytes]."""
        qtype = tensor_qtype(info)
        elems, nbytes = BLOCK[qtype]
        dims = list(info.shape)
        count = int(np.prod(dims)) // elems * nbytes
        raw = self.mmap[info.offset : info.offset + count]
        if qtype == QType.F32:
            return raw.view(np.float32).reshape(dims[::-1])
        if qtype == QType.F16:
            return raw.view(np.float16).reshape(dims[::-1])
        rows = dims[::-1][:-1]
        return raw.reshape(*rows, dims[0] // elems * nbytes)


class _Cursor:
    def __init__(self, buf, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        value = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return value

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", self.buf, self.pos)
            self.pos += 8 + n

    def value(self, vtype: int, arrays: bool):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                if not arrays:
                    self.skip_strings(count)
                    return None
                return [self.string() for _ in range(count)]
            if item == _ARRAY:  # nested arrays: never in the files we read; walk them
                return [self.value(_ARRAY, arrays) for _ in range(count)]
            fmt = _SCALARS[item]
            size = struct.calcsize(fmt)
            if not arrays and count > 64:
                self.pos += size * count
                return None
            values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos)
            self.pos += size * count
            return values.tolist()
        return self.scalar(_SCALARS[vtype])


def read_gguf(path: str | Path, arrays: bool = False) -> GGUFFile:
    """Parse a GGUF file's header: metadata (long arrays, the vocabulary among them, are
    skipped unless `arrays`: gguf's own reader builds a numpy view per token, seconds for a
    large vocabulary) and the tensor table; the tensors stay in the memory map."""
    path = Path(path)
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="c")
        cur = _Cursor(mm)
        if bytes(mm[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        version = cur.scalar("<4xI")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported (2 and later are)")
        n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
        fields, types = {}, {}
        for _ in range(n_fields):
            key = cur.string()
            vtype = cur.scalar("<I")
            item = cur.scalar("<I") if vtype == _ARRAY else None
            cur.pos -= 4 if vtype == _ARRAY else 0
            types[key] = (vtype, item)
            fields[key] = cur.value(vtype, arrays)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = int(fields.get("general.alignment") or DEFAULT_ALIGNMENT)
        start = -(-cur.pos // align) * align
    except (ValueError, struct.error, KeyError, OSError) as exc:
        raise GGUFWeightError(f"cannot read {path}: not a valid GGUF file ({exc})") from exc
    tensors = [GGUFTensorInfo(n, d, t, start + o) for n, d, t, o in infos]
    return GGUFFile(path, fields, tensors, mm, types)


def architecture(file: GGUFFile) -> str:
    arch = file.fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFWeightError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return arch


def type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def tensor_qtype(tensor) -> QType:
    """The tensor's QType; GGUFWeightError naming the tensor, its type and the supported ones."""
    try:
        return QType(int(tensor.tensor_type))
    except ValueError:
        supported = ", ".join(t.name for t in QType)
        raise GGUFWeightError(
            f"GGUF tensor {tensor.name!r} has type {type_name(int(tensor.tensor_type))}, "
            f"which is not supported (supported: {supported})"
        ) from None


def read_tensor(file: GGUFFile, tensor: GGUFTensorInfo) -> QuantizedTensor | torch.Tensor:
    """One 2-D GGUF tensor as it is stored, a view of the memory map: a QuantizedTensor
    [rows, cols], or a float torch tensor (any rank)."""
    qtype = tensor_qtype(tensor)
    data = torch.from_numpy(file.data(tensor))
    if qtype in FLOAT_TYPES:
        if qtype == QType.BF16:  # numpy has no bf16: raw bytes, two per element
            data = data.view(torch.bfloat16)
        return data
    dims = [int(n) for n in tensor.shape]
    if len(dims) != 2:
        raise GGUFWeightError(
            f"GGUF tensor {tensor.name!r} is a {len(dims)}-D {qtype.name} tensor; quantized "
            "tensors are read as 2-D weights (or stacked experts)"
        )
    return QuantizedTensor(qtype, (dims[1], dims[0]), data)


def _experts(file: GGUFFile, tensor: GGUFTensorInfo) -> Iterator[QuantizedTensor | torch.Tensor]:
    """The slices of a stacked [experts, rows, cols] tensor, one per expert."""
    qtype = tensor_qtype(tensor)
    dims = [int(n) for n in tensor.shape]  # GGUF order: cols, rows, experts
    if len(dims) != 3:
        raise GGUFWeightError(f"GGUF expert tensor {tensor.name!r} is not 3-D: {dims}")
    cols, rows, experts = dims
    data = torch.from_numpy(file.data(tensor))
    if qtype in FLOAT_TYPES:
        if qtype == QType.BF16:
            data = data.view(torch.bfloat16)
        yield from data
        return
    for e in range(experts):
        yield QuantizedTensor(qtype, (rows, cols), data[e])


def unpermute_rows(t: QuantizedTensor | torch.Tensor, heads: int) -> Any:
    """Undo llama.cpp's per-head permutation of query/key rows: its converter stored head h's
    rows as [the first half's pairs interleaved]; this returns the HF order. Whole rows move,
    so a quantized tensor's blocks are untouched."""
    rows = t.shape[0]
    if rows % (2 * heads):
        raise GGUFWeightError(f"{rows} rows cannot be {heads} heads of rotary pairs")
    half = rows // heads // 2
    order = torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)
    if isinstance(t, QuantizedTensor):
        return QuantizedTensor(t.qtype, t.shape, t.data.index_select(0, order))
    return t.index_select(0, order)


class GGUFCheckpoint:
    """The open file and how its names and fixes apply to the model it is loaded into."""

    def __init__(self, path: str | Path, hf_config: Any = None) -> None:
        self.path = Path(path)
        self.file = read_gguf(self.path)
        self.arch = architecture(self.file)
        self.hf_config = hf_config
        arch_names = getattr(hf_config, "architectures", None) or []
        self.mixtral = bool(arch_names) and arch_names[0] == "MixtralForCausalLM"
        self.block = _BLOCK | _ARCH_BLOCK.get(self.arch, {})
        self.experts = _MIXTRAL_EXPERTS if self.mixtral else _EXPERTS
        self.num_heads = self._count("attention.head_count", "num_attention_heads")
        self.num_kv_heads = self._count("attention.head_count_kv", "num_key_value_heads")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads

    def _count(self, key: str, config_field: str) -> int | None:
        value = self.file.fields.get(f"{self.arch}.{key}")
        if isinstance(value, list):  # per-layer counts: all equal for the families we run
            value = max(value)
        if value is None and self.hf_config is not None:
            value = getattr(self.hf_config, config_field, None)
        return None if value is None else int(value)

    def hf_name(self, name: str) -> str | None:
        """Our name for a GGUF tensor name (None: ignored; unknown names pass through, for the
        loader to report as unused)."""
        if name in _TOP:
            return _TOP[name]
        if _IGNORED.search(name):
            return None
        m = _BLOCK_NAME.match(name)
        if m is None or m.group(2) not in self.block:
            return name
        layer, part, kind = m.groups()
        module = self.block[part]
        if self.mixtral and part == "ffn_gate_inp":
            return f"model.layers.{layer}.block_sparse_moe.gate.{kind}"
        return f"model.layers.{layer}.{module}.{kind}"

    def tensors(self) -> Iterator[tuple[str, QuantizedTensor | torch.Tensor]]:
        """(our name, tensor) for every tensor the model may load, in file order."""
        for tensor in self.file.tensors:
            name = tensor.name
            m = _BLOCK_NAME.match(name)
            if m is not None and m.group(2) in self.experts:
                layer, part = m.group(1), m.group(2)
                moe = "block_sparse_moe" if self.mixtral else "mlp"
                for e, t in enumerate(_experts(self.file, tensor)):
                    yield f"model.layers.{layer}.{moe}.experts.{e}.{self.experts[part]}.weight", t
                continue
            hf_name = self.hf_name(name)
            if hf_name is None:
                logger.debug("GGUF tensor %s is recomputed from the config: skipped", name)
                continue
            yield hf_name, self._fixed(name, read_tensor(self.file, tensor))

    def _fixed(self, name: str, t: QuantizedTensor | torch.Tensor) -> Any:
        """The arch's fixes of llama.cpp's conversion."""
        if self.arch in _PERMUTED_ARCHS and name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = self.num_heads if ".attn_q." in name else self.num_kv_heads
            if heads is None:
                raise GGUFWeightError(f"{self.path.name}: no head count to un-permute {name}")
            return unpermute_rows(t, heads)
        if self.arch in _PERMUTED_ARCHS and name.endswith((".attn_q.bias", ".attn_k.bias")):
            heads = self.num_heads if ".attn_q." in name else self.num_kv_heads
            return unpermute_rows(t.reshape(-1, 1), heads).reshape(-1)
        if self.arch in _PLUS_ONE_NORM_ARCHS and name.endswith("norm.weight"):
            if isinstance(t, QuantizedTensor):
                raise GGUFWeightError(
                    f"GGUF tensor {name!r} is {t.qtype.name}: Gemma norm weights are stored as "
                    "1 + w and must be float (F32/F16/BF16) to be corrected"
                )
            return t.float() - 1.0
        return t


def gguf_tensors(
    path: str | Path, hf_config: Any = None
) -> Iterator[tuple[str, QuantizedTensor | torch.Tensor]]:
    """(our name, tensor) of every tensor of the GGUF file at `path` (GGUFCheckpoint.tensors)."""
    yield from GGUFCheckpoint(path, hf_config).tensors()


__all__ = [
    "GGUFCheckpoint",
    "GGUFWeightError",
    "QuantFormatError",
    "SUPPORTED_ARCHITECTURES",
    "gguf_tensors",
    "unpermute_rows",
]
