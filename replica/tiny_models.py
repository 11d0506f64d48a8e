"""Tiny random decoder checkpoints (Llama, Qwen2, Mistral) with a byte-level BPE tokenizer
trained here on local text: real HF directories (safetensors, config, tokenizer, chat template)
that load in transformers and in the engine, for the tests, the benchmarks and smoke tests of a
deployment where no model hub can be reached. Needs `tokenizers` and `transformers`."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

TINY_VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
TINY_EOS_ID = 2
# ChatML; with tools (Hermes-style calls, as Qwen2.5's template renders them): the signatures
# go into the system turn, assistant calls are <tool_call> JSON blocks, tool results user turns
# in <tool_response>. Without tools it renders exactly as plain ChatML.
# ChatML; with tools (Hermes-style calls, as Qwen2.5's template renders them): the signatures
# go into the system turn, assistant calls are <tool_call> JSON blocks, tool results user turns
# in <tool_response>. Without tools it renders exactly as plain ChatML. (Newlines are written
# as expressions: transformers renders templates with trim_blocks, which eats a newline that
# follows a block tag.)
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ 'Tools you can call, one JSON signature per line:\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '</tools>\\nTo call one, answer with <tool_call>\\n' }}"
    '{{ \'{"name": <function name>, "arguments": <arguments as a JSON object>}\' }}'
    "{{ '\\n</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls is defined "
    "and message.tool_calls %}{{ '<|im_start|>assistant\\n' }}"
    "{% if message['content'] %}{{ message['content'] + '\\n' }}{% endif %}"
    "{% for call in message.tool_calls %}"
    '{{ \'<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{ call.function.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' }}"
    "{{ message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_PARAGRAPHS = [
    "A replica runs an engine that schedules requests step by step. Each step gives a budget "
    "of tokens to the running requests first and then admits waiting ones.",
    "The key and value vectors of every token live in blocks of a paged cache. A block table "
    "maps each request's positions to the blocks it holds, so memory is never fragmented.",
    "When the cache runs out of blocks the newest request is preempted: its blocks are freed "
    "and it is computed again later, producing exactly the same tokens as before.",
    "Prefix caching hashes full blocks of tokens. Two prompts that share a system message "
    "share the blocks of that message, and the second prompt skips their computation.",
    "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly. "
    "Numbers such as 12, 345 and 6789 appear too, with punctuation: commas, dots; colons!",
]


def _training_text() -> list[str]:
    """A few paragraphs plus docstrings of stdlib modules: local, varied English and code."""
    import collections
    import functools
    import itertools
    import json as json_module
    import pathlib
    import re
    import textwrap

    texts = list(_PARAGRAPHS)
    for module in (collections, functools, itertools, json_module, pathlib, re, textwrap):
        texts.append(module.__doc__ or "")
        for name in sorted(dir(module)):
            doc = getattr(getattr(module, name), "__doc__", None)
            if isinstance(doc, str):
                texts.append(doc)
    return texts


def build_tiny_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_tiny_model(
    out_dir: Path, tokenizer_dir: Path, architecture: str, seed: int, **overrides
) -> None:
    """A random fp32 checkpoint whose weights are scaled up from HF's tiny init so greedy
    choices have clear margins, with random biases and norm weights so loading them matters."""
    import torch
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }
    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=TINY_EOS_ID,
        pad_token_id=0,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = model_cls[architecture](config_cls[architecture](**fields)).float().eval()
    draw_weights(model)
    save_checkpoint(model, out_dir, tokenizer_dir)


def draw_weights(model) -> None:
    """Weights scaled up from HF's init (0.1-scale normals) so greedy choices have clear
    margins; norm weights around 1."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)


def save_checkpoint(model, out_dir: Path, tokenizer_dir: Path) -> None:
    """`model` in fp32 safetensors with the tiny tokenizer (and its EOS) beside it."""
    import transformers

    model.generation_config = transformers.GenerationConfig(
        bos_token_id=0, eos_token_id=TINY_EOS_ID, pad_token_id=0
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    for item in Path(tokenizer_dir).iterdir():
        shutil.copy(item, Path(out_dir) / item.name)


# A bigger sibling of the tests' tiny Llama: enough compute per token that batch size and
# prompt length show up in step times, still far cheaper than the 135M default model.
BENCH_TINY_FIELDS = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
_TINY_NAME = "bench-tiny-llama-v1"
_DONE_MARKER = ".stepserve-bench-built"


def bench_tiny_model_dir() -> Path:
    """The benchmark's tiny random Llama (vocab 512), built on first use into the cache."""
    from replica.default_model import cache_root

    target = cache_root() / _TINY_NAME
    if (target / _DONE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{_TINY_NAME}-", dir=target.parent) as tmp:
        tok_dir, model_dir = Path(tmp) / "tokenizer", Path(tmp) / "model"
        tok_dir.mkdir()
        model_dir.mkdir()
        build_tiny_tokenizer(tok_dir)
        build_tiny_model(model_dir, tok_dir, "llama", seed=11, **BENCH_TINY_FIELDS)
        (model_dir / _DONE_MARKER).write_text("built\n")
        model_dir.chmod(0o755)
        if not (target / _DONE_MARKER).exists():
            shutil.rmtree(target, ignore_errors=True)
            model_dir.rename(target)
    return target


def resolve_model_dir(name: str) -> Path:
    """`tiny` (the benchmarks' tiny random Llama), `default` (SmolLM2-135M-Instruct
    de-quantized to fp32: the checkpoint the benchmarks' figures and their peers, transformers
    and vLLM, read), `default-gguf` (SmolLM2 as `stepserve serve` serves it: its Q4_1 GGUF), a
    local Hugging Face model directory or a GGUF file."""
    if name == "tiny":
        return bench_tiny_model_dir()
    if name == "default":
        from replica.default_model import dequantized_default_model_dir

        return dequantized_default_model_dir()
    from replica.default_model import resolve_model

    path = resolve_model(None if name == "default-gguf" else name)
    if not path.is_dir():
        raise ValueError(
            f"model {name!r}: expected tiny, default, default-gguf, a model directory or a "
            ".gguf file"
        )
    return path
