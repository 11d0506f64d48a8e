"""GGUF checkpoints served as they are: their metadata.

A GGUF file carries the model's config, its tokenizer and (usually) its chat template as
key-value metadata beside the quantized tensors. `resolve_model_path` turns a `.gguf` file, or a
directory holding exactly one, into a small metadata ("sidecar") directory in the stepserve
cache, made once per file and machine: config.json (with `architectures`), generation_config.json
and the tokenizer files, all as transformers reads them from the GGUF, and gguf.json naming the
file. Everything that reads a Hugging Face model directory (the loader's config, the tokenizers
of the engine and the ingress) reads the sidecar; it holds no weights: the loader reads the
tensors from the GGUF itself (`gguf_file_of`, replica/quant/gguf_weights.py). A Hugging Face
directory resolves to itself.

Every process that needs the model resolves `--model` on its own machine (EngineConfig.model_dir,
the ingress's tokenizer, `stepserve serve` before it starts anything): the first one there makes
the sidecar (seconds: transformers parses the metadata), the others find it."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from replica.cache import build_once, cache_root

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SIDECAR_RECORD = "gguf.json"  # written last: a directory with it is complete
SIDECAR_DIRNAME = "gguf"  # under cache_root()
SPLIT_NAME = re.compile(r"-\d{5}-of-\d{5}\.gguf$")

# The config.json `architectures` (replica/models/registry.py) of transformers' model_type
# for the GGUF architectures we run (gguf_weights.SUPPORTED_ARCHITECTURES; a llama GGUF named "mistral" reads as mistral, as in transformers).
MODEL_TYPE_ARCHITECTURES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# Gemma's turn format (<start_of_turn>user ... <end_of_turn>, the assistant's role named
# "model", a system message leading the first user turn), for a Gemma GGUF that carries no
# chat template: llama.cpp's converter writes none for some (the Gemma 3 270M file in the
# tests). The prompt starts with the bos token: the ingress encodes the rendered text without
# adding special tokens.
GEMMA_CHAT_TEMPLATE = (
    "{%- macro text_of(content) -%}"
    "{%- if content is string -%}{{ content | trim }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = text_of(messages[0]['content']) + '\\n\\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') }}"
    "{{ text_of(message['content']) + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
FALLBACK_CHAT_TEMPLATES = {"gemma2": GEMMA_CHAT_TEMPLATE, "gemma3": GEMMA_CHAT_TEMPLATE}
# Tokens that end a turn in the chat templates that use them (as llama.cpp's end-of-generation
# list): each one the template writes, and the vocabulary has, stops generation with the eos
# token (generation_config.json's eos_token_id).
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")


class GGUFError(ValueError):
    """A GGUF file that cannot be served, or a metadata directory that no longer matches its
    file; the message says which and why."""


# -- the metadata, read without the tensors ------------------------------------------------------
def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The key-value metadata of a GGUF file (versions 2 and 3) as gguf_weights.read_gguf reads
    it (string and long arrays, the vocabulary among them, present as None); a GGUFError when
    the file is not a GGUF or its metadata is cut short."""
    from replica.quant.gguf_weights import GGUFWeightError, read_gguf

    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != GGUF_MAGIC:
        raise GGUFError(
            f"{str(path)!r} is not a GGUF file (it starts with {head[:4]!r}, not "
            f"{GGUF_MAGIC!r}); expected a Hugging Face model directory or a .gguf file"
        )
    version = struct.unpack("<I", head[4:8])[0] if len(head) == 8 else None
    if version not in (2, 3):
        raise GGUFError(f"{str(path)!r}: GGUF version {version} is not supported (2 and 3 are)")
    try:
        return read_gguf(path).fields
    except GGUFWeightError as exc:
        raise GGUFError(
            f"{str(path)!r}: the GGUF metadata is truncated or corrupt ({exc.__cause__ or exc})"
        ) from None


def check_servable(path: Path, metadata: dict[str, Any]) -> str:
    """The file's GGUF architecture, when we can serve it: one file (not a split part), an
    architecture we run, its tokenizer in the metadata; a GGUFError that says what is wrong."""
    split_count = metadata.get("split.count", 1)
    if SPLIT_NAME.search(path.name) or (isinstance(split_count, int) and split_count > 1):
        raise GGUFError(
            f"{path.name} is one part of a split GGUF; stepserve reads single-file GGUFs: merge "
            "the parts first (llama.cpp: llama-gguf-split --merge <first part> <out>.gguf)"
        )
    arch = metadata.get("general.architecture")
    from replica.quant.gguf_weights import SUPPORTED_ARCHITECTURES

    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path.name}: GGUF architecture {arch!r} is not one stepserve runs; it runs GGUF "
            f"files of: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    experts = metadata.get(f"{arch}.expert_count", 0)
    if arch == "llama" and isinstance(experts, int) and experts > 0:
        raise GGUFError(
            f"{path.name}: a llama GGUF with {experts} experts (Mixtral-style) is not supported; "
            "serve its Hugging Face checkpoint instead"
        )
    missing = [
        key for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if key not in metadata
    ]
    if missing:
        raise GGUFError(
            f"{path.name} has no tokenizer in its metadata (missing {', '.join(missing)}); "
            "stepserve reads the tokenizer from the GGUF file"
        )
    return arch


# -- resolution --------------------------------------------------------------------------------
def resolve_model_path(path: str | Path) -> Path:
    """The model directory to read for `path`: a Hugging Face directory (config.json) as it is;
    a GGUF file, or a directory holding exactly one, its metadata directory (made on first use,
    atomically). Anything else is returned as it is, for the loader to say what is wrong."""
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        gguf = _gguf_in(p)
        if gguf is None:
            return p
    elif p.is_file():
        gguf = p
    else:
        return p
    return sidecar_dir(gguf)


def _gguf_in(directory: Path) -> Path | None:
    files = sorted(f for f in directory.glob("*.gguf") if f.is_file())
    if len(files) <= 1:
        return files[0] if files else None
    names = ", ".join(f.name for f in files)
    if all(SPLIT_NAME.search(f.name) for f in files):
        raise GGUFError(
            f"{str(directory)!r} holds a split GGUF ({names}); stepserve reads single-file "
            "GGUFs: merge the parts first (llama.cpp: llama-gguf-split --merge <first part> "
            "<out>.gguf)"
        )
    raise GGUFError(
        f"{str(directory)!r} holds {len(files)} .gguf files ({names}); pass the one to serve "
        "as --model"
    )


def file_stamp(stat: os.stat_result) -> dict[str, Any]:
    return {"size": stat.st_size, "mtime": stat.st_mtime}


def sidecar_path(gguf: str | Path, stat: os.stat_result | None = None) -> Path:
    """Where the metadata directory of this file, as it is now, lives: cache_root()/gguf/
    <stem>-<hash of its absolute path, size and mtime> (a changed file gets a new one)."""
    gguf = Path(os.path.abspath(Path(gguf).expanduser()))
    stamp = file_stamp(gguf.stat() if stat is None else stat)
    key = f"{gguf}\0{stamp['size']}\0{stamp['mtime']!r}".encode()
    return cache_root() / SIDECAR_DIRNAME / f"{gguf.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def sidecar_dir(gguf: str | Path) -> Path:
    """The metadata directory of a GGUF file, made once (concurrent makers: one wins the
    rename, the others use its directory)."""
    gguf = Path(os.path.abspath(Path(gguf).expanduser()))
    stat = gguf.stat()
    target = sidecar_path(gguf, stat)
    if (target / SIDECAR_RECORD).is_file():
        return target
    metadata = read_gguf_metadata(gguf)
    arch = check_servable(gguf, metadata)
    logger.info("reading the config and tokenizer of %s into %s (once)", gguf.name, target)

    def build(tmp: Path) -> None:
        template = _write_metadata(gguf, arch, tmp)
        record = {"gguf_file": str(gguf), **file_stamp(stat), "architecture": arch}
        record["chat_template"] = template
        (tmp / SIDECAR_RECORD).write_text(json.dumps(record, indent=2) + "\n")

    return build_once(target, SIDECAR_RECORD, build)


def gguf_file_of(model_dir: str | Path) -> Path | None:
    """The GGUF file whose metadata directory `model_dir` is (its weights are read from there),
    or None for a Hugging Face directory. A GGUFError when the file is gone or has changed
    since the directory was made (its config and tokenizer may no longer match it)."""
    record_path = Path(model_dir) / SIDECAR_RECORD
    if not record_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_text())
        gguf, stamp = Path(record["gguf_file"]), {"size": record["size"], "mtime": record["mtime"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GGUFError(
            f"{record_path} is unreadable ({exc}); delete {model_dir} and start again"
        ) from None
    try:
        stat = gguf.stat()
    except FileNotFoundError:
        raise GGUFError(
            f"{model_dir} holds the metadata of {gguf}, which no longer exists"
        ) from None
    if file_stamp(stat) != stamp:
        raise GGUFError(
            f"{gguf} has changed since its config and tokenizer were read into {model_dir}; "
            f"start again with --model {gguf} to read them anew"
        )
    return gguf


# -- the metadata directory's files -------------------------------------------------------------
@contextlib.contextmanager
def _one_metadata_parse() -> Iterator[None]:
    """transformers parses a GGUF's metadata (every token string, with gguf's reader) for the
    config, and again for AutoTokenizer's choice of class: ~12 s each for Gemma's 262k-token
    vocabulary. In this block the second parse of a file is a copy of the first (the function
    AutoConfig and AutoTokenizer import when called; its result is the same either way)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    real = gguf_utils.load_gguf_checkpoint
    parsed: dict[str, Any] = {}

    def parse_once(path, *args, **kwargs):
        if args or any(kwargs.values()):  # tensors asked for: not memoized
            return real(path, *args, **kwargs)
        key = str(path)
        if key not in parsed:
            parsed[key] = real(path, *args, **kwargs)
        return copy.deepcopy(parsed[key])

    gguf_utils.load_gguf_checkpoint = parse_once
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = real


def _write_metadata(gguf: Path, arch: str, out: Path) -> str | None:
    """config.json, generation_config.json and the tokenizer files of `gguf` into `out`, as
    transformers reads them; returns where the chat template came from (None: it has none)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    src, name = str(gguf.parent), gguf.name
    with _one_metadata_parse():
        config = AutoConfig.from_pretrained(src, gguf_file=name)
        architecture = MODEL_TYPE_ARCHITECTURES.get(config.model_type)
        if architecture is None:
            raise GGUFError(
                f"{name}: transformers reads it as model type {config.model_type!r}, which "
                f"stepserve does not run (it runs: {', '.join(sorted(MODEL_TYPE_ARCHITECTURES))})"
            )
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    if tokenizer.eos_token is None:
        raise GGUFError(f"{name}: its tokenizer metadata names no eos token")
    source = "gguf" if tokenizer.chat_template else None
    if source is None and arch in FALLBACK_CHAT_TEMPLATES:
        logger.warning(
            "%s carries no chat template: using stepserve's %s turn format for chats", name, arch
        )
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATES[arch]
        source = f"stepserve's {arch} template (the file has none)"
    # the turns end with the tokenizer's eos token (as the default model's conversion set it),
    # and with every end-of-turn token the chat template writes
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    eos_ids = [eos_id]
    if isinstance(tokenizer.chat_template, str):
        vocab = tokenizer.get_vocab()
        for token in END_OF_TURN_TOKENS:
            if token in tokenizer.chat_template and token in vocab and vocab[token] not in eos_ids:
                eos_ids.append(vocab[token])
    config.architectures = [architecture]
    config.eos_token_id = eos_id
    if hasattr(config, "quantization_config"):  # the weights are read by our own loader
        del config.quantization_config
    pad_id = getattr(config, "pad_token_id", None)
    generation = GenerationConfig(
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_id=eos_ids if len(eos_ids) > 1 else eos_id,
        pad_token_id=eos_id if pad_id is None else pad_id,
    )
    config.save_pretrained(out)
    generation.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return source
