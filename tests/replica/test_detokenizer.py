"""The incremental detokenizer on byte-level tokens: one token per byte, as byte-level BPE
vocabularies have for bytes they did not merge (a multi-byte character then spans tokens)."""

from replica.detokenizer import IncrementalDetokenizer


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
