"""Tiny random checkpoints in the style of each tool-call and reasoning family: the tests'
tiny BPE tokenizer with the families' marker tokens added (`<think>`, `</think>`,
`[TOOL_CALLS]`, `[ARGS]`, `<|python_tag|>`: as added tokens that decode, one id each) and a
small chat template per family written for these tests, beside one shared random Qwen2
checkpoint whose vocabulary covers them."""

from __future__ import annotations

import shutil
from pathlib import Path

from replica.tiny_models import TINY_VOCAB, build_tiny_model

MARKERS = ["<think>", "</think>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]

_ROLES = (
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
)
_TOOLS_JSON = "{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}"

# the generation prompt: Qwen3 closes an empty think block when thinking is off
_QWEN3_GEN = (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)

TEMPLATES = {
    # Qwen3: Hermes calls, <think> written by the model
    "qwen3": "{% if tools %}{{ '<|im_start|>system\\n<tools>\\n' }}"
    + _TOOLS_JSON
    + '{{ \'</tools>\\nCall with <tool_call>\\n{"name": ..., "arguments": ...}\\n'
    "</tool_call><|im_end|>\\n' }}{% endif %}" + _ROLES + _QWEN3_GEN,
    # DeepSeek-R1: the generation prompt opens <think>
    "deepseek_r1": _ROLES
    + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}",
    # Llama 3.x JSON calls
    "llama3_json": "{% if tools %}{{ '<|im_start|>system\\nRespond with a JSON function call "
    '{"name": function name, "parameters": dictionary of argument name and its value}, '
    "after <|python_tag|> if you like.\\n' }}"
    + _TOOLS_JSON
    + "{{ '<|im_end|>\\n' }}{% endif %}"
    + _ROLES
    + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    # Mistral: [AVAILABLE_TOOLS] and [TOOL_CALLS]
    "mistral": "{% if tools %}{{ '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]"
    'Call tools as [TOOL_CALLS][{"name": ..., "arguments": ...}]\\n\' }}{% endif %}'
    + _ROLES
    + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    # Qwen3-Coder: XML calls
    "qwen3_coder": "{% if tools %}{{ '<|im_start|>system\\n<tools>\\n' }}"
    + _TOOLS_JSON
    + "{{ '</tools>\\nCall as <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n"
    "</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}{% endif %}" + _ROLES + _QWEN3_GEN,
    # Llama 3.2 pythonic
    "pythonic": "{% if tools %}{{ '<|im_start|>system\\nCall functions as "
    "[func_name(param=value), ...]\\n' }}"
    + _TOOLS_JSON
    + "{{ '<|im_end|>\\n' }}{% endif %}"
    + _ROLES
    + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
}


def build_marker_tokenizer(tiny_tokenizer_dir: Path, out_dir: Path, special: bool = False) -> None:
    """The tiny tokenizer with the MARKERS added; `special`: as special tokens, as Mistral's
    `[TOOL_CALLS]` and Llama's `<|python_tag|>` are (a decode that skips special tokens drops
    them)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    tok.add_tokens([AddedToken(m, special=special, normalized=False) for m in MARKERS])
    tok.save_pretrained(out_dir)


def build_family_models(
    tiny_tokenizer_dir: Path, root: Path, special: bool = False
) -> dict[str, Path]:
    """One model directory per template family under `root` (weights shared); `special`:
    the markers are special tokens."""
    import json

    tok_dir, base = root / "tokenizer", root / "base"
    tok_dir.mkdir(parents=True)
    base.mkdir()
    build_marker_tokenizer(tiny_tokenizer_dir, tok_dir, special)
    build_tiny_model(
        base,
        tok_dir,
        "qwen2",
        seed=5,
        tie_word_embeddings=True,
        vocab_size=TINY_VOCAB + 16,
        max_position_embeddings=2048,
    )
    dirs = {}
    for family, template in TEMPLATES.items():
        out = root / family
        shutil.copytree(base, out)
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (out / "tokenizer_config.json").write_text(json.dumps(config))
        (out / "chat_template.jinja").unlink(missing_ok=True)
        dirs[family] = out
    return dirs
