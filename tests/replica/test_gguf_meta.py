"""GGUF checkpoints' metadata (replica/quant/gguf_meta.py): a `.gguf` file, or a directory
holding one, resolves to a metadata directory in the stepserve cache, made once per file (a
changed file gets a new one), holding the config, generation config, tokenizer and chat template
as transformers reads them from the GGUF, and no weights; a HF directory resolves to itself.
Checked on small GGUF files written here and on the real SmolLM2 (the default model) and
Gemma 3 270M files, up to the chat prompt the ingress renders. No weights are loaded."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest

from replica.config import EngineConfig
from replica.quant import gguf_meta
from replica.quant.gguf_meta import (
    GGUFError,
    gguf_file_of,
    read_gguf_metadata,
    resolve_model_path,
)
from tests.replica.test_loader import _as_read

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
TEXTS = ["The quick brown fox", "  spaces\tand\nnewlines ", "émigré 日本語 🙂", "hello", ""]


def write_gguf(
    path: Path,
    arch: str = "llama",
    *,
    tokenizer: bool = True,
    template: str | None = CHATML,
    uint32: dict[str, int] | None = None,
    name: str = "tiny",
) -> Path:
    """A small GGUF: a 1-layer model's metadata, a byte-level BPE tokenizer (the 256 byte
    symbols, three ChatML specials, `hello` merged) and one tensor."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    for key, value in (uint32 or {}).items():
        w.add_uint32(key, value)
    vocab = 300
    if tokenizer:
        tokens = SPECIALS + list(bytes_to_unicode().values()) + ["he", "hel", "hell", "hello"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
        w.add_token_merges(["h e", "he l", "hel l", "hell o"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        if template is not None:
            w.add_chat_template(template)
        vocab = len(tokens)
    w.add_tensor("token_embd.weight", np.zeros((vocab, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("STEPSERVE_CACHE", str(root))
    return root


def sidecars(cache: Path) -> list[str]:
    """The directories under the cache's gguf/ (partial ones included: they start with '.')."""
    root = cache / "gguf"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# -- resolution --------------------------------------------------------------------------------
def test_a_hf_directory_and_a_missing_path_resolve_to_themselves(tiny_llama_dir, tmp_path, cache):
    assert resolve_model_path(tiny_llama_dir) == tiny_llama_dir
    assert resolve_model_path(str(tiny_llama_dir)) == tiny_llama_dir
    assert gguf_file_of(tiny_llama_dir) is None
    assert resolve_model_path(tmp_path / "nope") == tmp_path / "nope"  # the loader says why
    assert sidecars(cache) == []


def test_a_gguf_file_and_its_directory_resolve_to_one_metadata_directory(tmp_path, cache):
    gguf = write_gguf(tmp_path / "models" / "tiny-q8.gguf")
    d = resolve_model_path(gguf)
    assert d.parent == cache / "gguf" and d.name.startswith("tiny-q8-")
    assert resolve_model_path(gguf.parent) == d  # the directory holding it
    assert resolve_model_path(os.path.relpath(gguf)) == d  # relative: the same file
    assert resolve_model_path(d) == d  # resolving again is a no-op
    assert sidecars(cache) == [d.name]
    assert gguf_file_of(d) == gguf
    record = json.loads((d / "gguf.json").read_text())
    stat = gguf.stat()
    assert record["gguf_file"] == str(gguf)
    assert (record["size"], record["mtime"]) == (stat.st_size, stat.st_mtime)
    assert record["chat_template"] == "gguf"
    files = {p.name for p in d.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "gguf.json"} <= files
    assert not [f for f in files if f.endswith((".safetensors", ".bin", ".gguf"))]  # no weights
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (16, 1)
    assert "quantization_config" not in config
    generation = json.loads((d / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] == 2  # <|im_end|>
    assert EngineConfig(model=str(gguf)).model_dir() == d
    assert EngineConfig(model=str(gguf)).served_name() == "tiny-q8"
    assert EngineConfig(model=str(gguf.parent)).served_name() == "models"


def test_the_metadata_directory_is_reused_and_made_anew_for_a_changed_file(
    tmp_path, cache, monkeypatch
):
    gguf = write_gguf(tmp_path / "m.gguf")
    first = resolve_model_path(gguf)

    def no_second_read(*_):
        raise AssertionError("read again")

    with monkeypatch.context() as m:
        m.setattr(gguf_meta, "_write_metadata", no_second_read)
        assert resolve_model_path(gguf) == first  # found: not read again
    write_gguf(gguf, name="tiny-v2", template=CHATML.replace("assistant", "bot"))
    os.utime(gguf, ns=(1, 1))  # a changed mtime for sure, whatever the clock's resolution
    with pytest.raises(GGUFError, match="has changed since its config and tokenizer were read"):
        gguf_file_of(first)
    second = resolve_model_path(gguf)
    assert second != first and gguf_file_of(second) == gguf
    assert "bot" in (second / "chat_template.jinja").read_text()
    gguf.unlink()
    with pytest.raises(GGUFError, match="which no longer exists"):
        gguf_file_of(second)


def test_the_metadata_directory_appears_whole_or_not_at_all(tmp_path, cache, monkeypatch):
    gguf = write_gguf(tmp_path / "m.gguf")
    real_write = gguf_meta._write_metadata

    def fails(*_):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_meta, "_write_metadata", fails)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model_path(gguf)
    assert sidecars(cache) == []  # the partial directory is gone
    # a partial directory left at the target (a crash) is replaced
    target = gguf_meta.sidecar_path(gguf)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    monkeypatch.setattr(gguf_meta, "_write_metadata", real_write)
    assert resolve_model_path(gguf) == target and gguf_file_of(target) == gguf
    assert sidecars(cache) == [target.name]

    # another process finishes first: its directory is used, ours removed
    other = write_gguf(tmp_path / "other.gguf")
    other_target = gguf_meta.sidecar_path(other)

    def races(gguf_path, arch, out):
        result = real_write(gguf_path, arch, out)
        other_target.mkdir()
        (other_target / "gguf.json").write_text('{"winner": true}')
        return result

    monkeypatch.setattr(gguf_meta, "_write_metadata", races)
    assert resolve_model_path(other) == other_target
    assert json.loads((other_target / "gguf.json").read_text()) == {"winner": True}
    assert sidecars(cache) == sorted([target.name, other_target.name])


# -- what cannot be served ---------------------------------------------------------------------
def test_files_that_are_no_servable_gguf_are_clear_errors(tmp_path, cache):
    text = tmp_path / "model.gguf"
    text.write_text("not a gguf at all")
    with pytest.raises(GGUFError, match=r"is not a GGUF file \(it starts with b'not '"):
        resolve_model_path(text)
    cut = tmp_path / "cut" / "m.gguf"
    write_gguf(cut)
    cut.write_bytes(cut.read_bytes()[:200])
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        resolve_model_path(cut)
    with pytest.raises(GGUFError, match=r"architecture 'mamba' is not one stepserve runs; "
                       r"it runs GGUF files of: gemma2, gemma3, llama, phi3, qwen2"):  # fmt: skip
        resolve_model_path(write_gguf(tmp_path / "mamba.gguf", "mamba"))
    moe = write_gguf(tmp_path / "moe.gguf", uint32={"llama.expert_count": 8})
    with pytest.raises(GGUFError, match="a llama GGUF with 8 experts"):
        resolve_model_path(moe)
    with pytest.raises(GGUFError, match=r"has no tokenizer in its metadata \(missing "):
        resolve_model_path(write_gguf(tmp_path / "notok.gguf", tokenizer=False))
    split = write_gguf(tmp_path / "split" / "m-00001-of-00002.gguf")
    with pytest.raises(GGUFError, match="one part of a split GGUF.*llama-gguf-split --merge"):
        resolve_model_path(split)
    write_gguf(tmp_path / "split" / "m-00002-of-00002.gguf")
    with pytest.raises(GGUFError, match="holds a split GGUF"):
        resolve_model_path(tmp_path / "split")
    renamed = write_gguf(tmp_path / "renamed.gguf", uint32={"split.count": 3})
    with pytest.raises(GGUFError, match="one part of a split GGUF"):
        resolve_model_path(renamed)
    two = tmp_path / "two"
    write_gguf(two / "a.gguf")
    write_gguf(two / "b.gguf")
    with pytest.raises(GGUFError, match=r"holds 2 .gguf files \(a.gguf, b.gguf\); pass the one"):
        resolve_model_path(two)
    assert sidecars(cache) == []  # nothing made for any of them


def test_the_architectures_we_map_are_the_models_we_run():
    from replica.models.registry import MODEL_REGISTRY

    assert set(gguf_meta.MODEL_TYPE_ARCHITECTURES.values()) <= set(MODEL_REGISTRY)


def test_the_header_reader_reads_what_gguf_writes(tmp_path):
    from gguf import GGUFReader, GGUFValueType

    path = write_gguf(tmp_path / "m.gguf", uint32={"llama.expert_count": 0})
    ours = read_gguf_metadata(path)
    theirs = GGUFReader(str(path)).fields
    assert set(ours) == set(theirs) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, value in ours.items():
        if value is None:  # a string array (the vocabulary) or a long one, skipped
            assert theirs[key].types[0] == GGUFValueType.ARRAY, key
            assert theirs[key].types[1] == GGUFValueType.STRING or len(theirs[key].data) > 64
        else:
            assert value == pytest.approx(theirs[key].contents()), key


# -- the real files: config, tokenizer and chat template as transformers reads them ----------------
def _ingress(model: str):
    """The ingress's request handling with its own tokenizer load (resolving `model`)."""
    from router.ingress import IngressCore
    from router.policy import RoutingConfig
    from router.settings import IngressSettings

    class Handle:  # the LLM deployment's handle: not called here
        def options(self, **_):
            return self

    settings = IngressSettings(
        model_name="m", model_dir=model, engine=EngineConfig(model=model), routing=RoutingConfig()
    )
    core = IngressCore(Handle(), settings)
    asyncio.run(core.tokenizer_loaded())
    return core


def _chat_ids(core, messages: list[dict]) -> list[int]:
    """The prompt /v1/chat/completions renders for these messages."""
    from router.protocol import ChatCompletionRequest

    return core.request_chat_prompt(ChatCompletionRequest.model_validate({"messages": messages}))


def _same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.chat_template == theirs.chat_template
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids), text


def test_the_default_model_is_served_from_its_gguf_as_transformers_reads_it(default_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    from replica.default_model import find_gguf_file
    from replica.engine.core import load_eos_token_ids
    from replica.loader import load_hf_config
    from replica.tokenizer import declared_eos_token_id, generic_tokenizer_class, load_tokenizer

    gguf = find_gguf_file()
    assert gguf_file_of(default_model_dir) == gguf
    assert EngineConfig().model_dir() == default_model_dir
    assert EngineConfig().served_name() == "SmolLM2-135M-Instruct"
    assert not list(default_model_dir.glob("*.safetensors"))
    src, name = str(gguf.parent), gguf.name
    ours = load_hf_config(default_model_dir)
    theirs = AutoConfig.from_pretrained(src, gguf_file=name)
    assert ours.architectures == ["LlamaForCausalLM"]
    assert {**_as_read(ours), "architectures": None} == _as_read(theirs)
    tokenizer = load_tokenizer(default_model_dir)
    assert generic_tokenizer_class(default_model_dir) is not None  # the direct path
    _same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(src, gguf_file=name))
    assert tokenizer.eos_token == "<|im_end|>"
    assert declared_eos_token_id(default_model_dir) == tokenizer.eos_token_id == 2
    assert load_eos_token_ids(default_model_dir, None) == {2}

    core = _ingress(str(gguf))  # the path the user gave: resolved by the ingress
    ids = _chat_ids(core, [{"role": "user", "content": "What is the capital of France?"}])
    text = tokenizer.decode(ids)
    assert text == tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.timeout(300)
def test_gemma3_chats_in_its_turn_format_though_its_gguf_has_no_template(gemma3_270m_gguf):
    """The Gemma 3 270M file carries no chat template (llama.cpp wrote none into it): its
    metadata directory gets Gemma's turn format, and its turns end at <end_of_turn>."""
    from transformers import GemmaTokenizer

    from replica.engine.core import load_eos_token_ids
    from replica.loader import load_hf_config
    from replica.models.registry import resolve_model_class
    from replica.tokenizer import load_tokenizer

    assert "tokenizer.chat_template" not in read_gguf_metadata(gemma3_270m_gguf)
    d = resolve_model_path(gemma3_270m_gguf)
    record = json.loads((d / "gguf.json").read_text())
    assert record["architecture"] == "gemma3" and "the file has none" in record["chat_template"]
    config = load_hf_config(d)
    assert resolve_model_class(config.architectures).__name__ == "Gemma3ForCausalLM"
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (640, 18, 256)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 1)
    assert (config.sliding_window, config.vocab_size) == (512, 262144)
    assert config.layer_types.count("full_attention") == 3
    tokenizer = load_tokenizer(d)
    # what AutoTokenizer builds from the GGUF (its class, read without the config's second parse)
    reference = GemmaTokenizer.from_pretrained(str(gemma3_270m_gguf.parent),
                                               gguf_file=gemma3_270m_gguf.name)  # fmt: skip
    reference.chat_template = gguf_meta.GEMMA_CHAT_TEMPLATE
    _same_tokenizer(tokenizer, reference)
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert load_eos_token_ids(d, None) == {tokenizer.eos_token_id, end_of_turn} == {1, 106}

    core = _ingress(str(gemma3_270m_gguf))
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]},
    ]
    ids = _chat_ids(core, messages)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids) == (
        "<bos><start_of_turn>user\nAnswer in one word.\n\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert ids.count(end_of_turn) == 3
