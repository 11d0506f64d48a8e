"""Tiny GGUF checkpoints for the quantized-weights tests (replica/tiny_models_gguf.py), each
built once per session into a temporary directory with a sidecar model dir beside it, and
transformers' reading of the same file: the reference the engine is compared against."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch

# per GGUF tensor name pattern (first match wins), its block format; the rest Q8_0, norms F32
LLAMA_QTYPES = {
    "token_embd.weight": "Q8_0",  # tied: the LM head multiplies by it too
    # layer 0: one fused QKV of three types, K-quant down_proj (a whole 256-block per TP rank)
    "blk.0.attn_q.weight": "Q8_0",
    "blk.0.attn_k.weight": "Q4_0",
    "blk.0.attn_v.weight": "Q4_1",
    "blk.0.attn_output.weight": "Q4_0",
    "blk.0.ffn_gate.weight": "Q4_1",
    "blk.0.ffn_up.weight": "Q8_0",
    "blk.0.ffn_down.weight": "Q4_K",
    # layer 1: float linears (an all-float gate_up becomes a plain packed Parameter)
    "blk.1.attn_output.weight": "F16",
    "blk.1.ffn_gate.weight": "F32",
    "blk.1.ffn_up.weight": "F16",
    "blk.1.ffn_down.weight": "Q6_K",
    # layer 2: quantized and float parts in one QKV
    "blk.2.attn_q.weight": "Q4_1",
    "blk.2.attn_k.weight": "Q4_1",
    "blk.2.attn_v.weight": "F16",
    "blk.2.ffn_down.weight": "Q5_K",
}
QWEN2_QTYPES = {  # QKV biases (F32), an untied LM head
    "token_embd.weight": "Q4_1",
    "output.weight": "Q4_0",
    "blk.*.attn_q.weight": "Q4_0",
    "blk.*.ffn_down.weight": "Q6_K",
}
QWEN3_QTYPES = {  # q/k norms; head_dim 128 makes o_proj 256 wide: a K-quant
    "blk.*.attn_output.weight": "Q4_K",
    "blk.*.ffn_down.weight": "Q5_K",
    "blk.1.attn_k.weight": "Q4_0",
}
GEMMA3_QTYPES = {  # norms stored as 1 + w
    "blk.*.ffn_down.weight": "Q6_K",
    "blk.0.attn_v.weight": "Q4_1",
}
QWEN3MOE_QTYPES = {  # stacked experts of two types, a quantized router (read as float)
    "blk.*.ffn_gate_exps.weight": "Q4_0",
    "blk.*.ffn_up_exps.weight": "Q8_0",
    "blk.0.ffn_down_exps.weight": "Q6_K",
    "blk.1.ffn_down_exps.weight": "Q4_K",
    "blk.0.ffn_gate_inp.weight": "Q8_0",
    "blk.1.ffn_gate_inp.weight": "F32",
    "blk.*.attn_output.weight": "Q4_1",
}
PHI3_QTYPES = {  # fused QKV and gate_up, split by rows into our parts
    "blk.0.attn_qkv.weight": "Q4_1",
    "blk.*.ffn_down.weight": "Q5_K",
    "output.weight": "Q4_0",
}
QTYPES = {
    "llama": LLAMA_QTYPES,
    "qwen2": QWEN2_QTYPES,
    "qwen3": QWEN3_QTYPES,
    "qwen3moe": QWEN3MOE_QTYPES,
    "gemma3": GEMMA3_QTYPES,
    "phi3": PHI3_QTYPES,
}
SEEDS = {"llama": 21, "qwen2": 22, "qwen3": 23, "gemma3": 24, "qwen3moe": 25, "phi3": 26}


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="stepserve-gguf-tests-"))
    atexit.register(shutil.rmtree, root, True)
    return root


@functools.cache
def tiny_gguf_dir(arch: str, tokenizer: bool = False) -> Path:
    """The sidecar model directory of the tiny `arch` GGUF (QTYPES[arch]); without the SmolLM2
    vocabulary's metadata unless `tokenizer` (transformers parses it for seconds per read)."""
    from replica.tiny_models_gguf import build_tiny_gguf, write_sidecar

    name = f"tiny-{arch}{'-tok' if tokenizer else ''}"
    path = build_tiny_gguf(
        _root() / f"{name}.gguf",
        arch,
        QTYPES[arch],
        seed=SEEDS[arch],
        tokenizer_gguf=None if tokenizer else False,
    )
    return write_sidecar(path, _root() / name)


def gguf_path(sidecar: Path) -> Path:
    from replica.quant.gguf_meta import gguf_file_of

    return gguf_file_of(sidecar)


@functools.cache
def hf_gguf_model(sidecar: Path):
    """transformers' model of the sidecar's GGUF (it de-quantizes every tensor), fp32, eager."""
    from transformers import AutoModelForCausalLM

    path = gguf_path(sidecar)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@functools.cache
def hf_greedy(sidecar: Path, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    model = hf_gguf_model(sidecar)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()


def hf_expected(sidecar: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    return [hf_greedy(sidecar, tuple(p), n) for p, n in zip(prompts, max_tokens)]


@torch.inference_mode()
def prompt_logits(runner, prompt: list[int]) -> torch.Tensor:
    """The runner's model's logits [len(prompt), vocab] at every position of one prompt (a
    whole-prompt forward into the runner's KV cache)."""
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    hidden = runner._forward(prompt, [0], [len(prompt)], [blocks], runner.kv_caches)
    return runner.model.compute_logits(hidden).float()
