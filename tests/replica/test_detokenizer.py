"""The incremental detokenizer on byte-level tokens: one token per byte, as byte-level BPE
vocabularies have for bytes they did not merge (a multi-byte character then spans tokens)."""

from replica.detokenizer import IncrementalDetokenizer, special_ids


class ByteTokenizer:
    """Token id = one byte; decoding replaces incomplete UTF-8 sequences with U+FFFD, as
    Hugging Face tokenizers' byte-level decoders do."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(prompt: bytes, output: bytes) -> list[str]:
    detok = IncrementalDetokenizer(ByteTokenizer(), list(prompt))
    deltas = []
    for i, byte in enumerate(output):
        detok.add_tokens([byte])
        deltas.append(detok.take_delta(finished=i == len(output) - 1))
    return deltas


def test_a_character_split_across_output_tokens_comes_with_its_last_byte():
    assert stream(b"ab", "｠c".encode()) == ["", "", "｠", "c"]


def test_an_output_token_that_completes_the_prompts_last_character_yields_it_at_once():
    wide = "｠".encode()  # 3 bytes: the prompt ends after 2 of them
    # before: nothing for the completing byte, and nothing until the next character came
    # (then only that one): the character was lost and the first text came a token late
    assert stream(b"ab" + wide[:2], wide[2:] + b"c") == ["｠", "c"]


def test_a_broken_prompt_end_is_not_emitted_when_the_output_starts_a_new_character():
    wide = "｠".encode()
    assert stream(b"ab" + wide[:2], "！".encode() + b"d") == ["", "", "！", "d"]


def test_a_broken_prompt_end_completed_over_two_output_tokens():
    wide = "｠".encode()
    assert stream(b"ab" + wide[:1], wide[1:] + b"e") == ["", "｠", "e"]


def test_plain_ascii_is_one_delta_per_token():
    assert stream(b"hello ", b"world") == list("world")


def test_a_context_window_that_starts_inside_a_character_emits_none_of_its_junk():
    """The detokenizer keeps only the prompt's last tokens as context; when that window starts
    inside a character its first bytes decode as U+FFFD too, and none of them is output."""
    emoji = "😀".encode()  # 4 bytes: the window holds its last 1 and 3 of the next one
    assert stream(b"q" + emoji + emoji[:3], emoji[3:] + b"z") == ["😀", "z"]
    assert stream(b"ab\x80" + "｠".encode()[:2], "｠".encode()[2:]) == ["｠"]


def test_a_stop_string_made_of_a_completed_character_stops_there():
    wide = "｠".encode()
    detok = IncrementalDetokenizer(ByteTokenizer(), list(b"ab" + wide[:2]), stop=["｠c"])
    assert detok.add_tokens(list(wide[2:] + b"cd")) == 2  # the stop string ends at "c"
    assert detok.stop_string == "｠c" and detok.take_delta(finished=True) == ""


# -- special tokens kept (skip_special_tokens=False) on a real tokenizer -----------------------
import pytest  # noqa: E402

from replica.engine.output_processor import OutputProcessor  # noqa: E402
from replica.request import RequestOutput, SamplingParams  # noqa: E402
from tests.parser_models import MARKERS, build_marker_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def special_tokenizer(tiny_tokenizer_dir, tmp_path_factory):
    """The tiny tokenizer with `<think>`, `[TOOL_CALLS]`, `<|python_tag|>`... as special."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("special-markers")
    build_marker_tokenizer(tiny_tokenizer_dir, out, special=True)
    return AutoTokenizer.from_pretrained(str(out))


OUTPUT = '<think>hm, ok</think>Sure [TOOL_CALLS][{"name": "f"}]<|python_tag|>{"a": 1}'


def incremental(tok, prompt_ids, ids, skip):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = []
    for token_id in ids:
        detok.add_tokens([token_id])
        deltas.append(detok.take_delta(finished=False))
    return deltas + [detok.take_delta(finished=True)]


def test_special_markers_decode_incrementally_when_kept(special_tokenizer):
    tok = special_tokenizer
    assert all(tok.convert_tokens_to_ids(m) in special_ids(tok) for m in MARKERS)
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    ids = tok.encode(OUTPUT, add_special_tokens=False)
    kept = incremental(tok, prompt, ids, skip=False)
    assert "".join(kept) == OUTPUT == tok.decode(ids, skip_special_tokens=False)
    # each marker arrives whole, in the delta of its own token
    for marker in MARKERS[:3] + ["<|python_tag|>"]:
        assert marker in kept
    skipped = "".join(incremental(tok, prompt, ids, skip=True))
    assert skipped == tok.decode(ids, skip_special_tokens=True)
    assert not any(m in skipped for m in MARKERS)


def _process(tok, params, ids, finish, stop_reason=None):
    proc = OutputProcessor(tok)
    proc.add("r", tok.encode("<|im_start|>assistant\n", add_special_tokens=False), params)
    texts = []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        out = RequestOutput(
            "r",
            [token_id],
            "",
            4,
            i + 1,
            finish_reason=finish if last else None,
            stop_reason=stop_reason if last else None,
        )
        done, _ = proc.process(out)
        texts.append(done.new_text)
        if done.finished:
            break
    return "".join(texts), done


def test_the_stop_token_is_not_text_when_special_tokens_are_kept(special_tokenizer):
    tok = special_tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("[TOOL_CALLS]hi", add_special_tokens=False)
    kept = SamplingParams(max_tokens=50, skip_special_tokens=False)
    text, out = _process(tok, kept, ids + [eos], "stop")
    assert text == "[TOOL_CALLS]hi" and out.num_output_tokens == len(ids) + 1
    assert out.new_token_ids == [eos]  # the token still counts; only its text is left out
    # a special stop_token_id alike; a special token that ends by length is text
    marker = tok.convert_tokens_to_ids("[ARGS]")
    params = SamplingParams(max_tokens=50, skip_special_tokens=False, stop_token_ids=[marker])
    assert _process(tok, params, ids + [marker], "stop", marker)[0] == "[TOOL_CALLS]hi"
    assert _process(tok, kept, ids + [marker], "length")[0] == "[TOOL_CALLS]hi[ARGS]"
    # the default leaves every special token out, as before
    default = SamplingParams(max_tokens=50)
    assert _process(tok, default, ids + [eos], "stop")[0] == "hi"


def test_stop_strings_hold_with_special_tokens_kept(special_tokenizer):
    tok = special_tokenizer
    ids = tok.encode("ab[TOOL_CALLS]cd<think>ef", add_special_tokens=False)
    params = SamplingParams(max_tokens=50, skip_special_tokens=False, stop=["]cd<th"])
    text, out = _process(tok, params, ids, None)
    assert text == "ab[TOOL_CALLS" and out.finish_reason == "stop"
    assert out.stop_reason == "]cd<th"
