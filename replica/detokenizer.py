"""Incremental detokenization and stop strings, done in the replica so that a request's KV
blocks are freed the step its stop string appears."""

from __future__ import annotations

import os

from replica.errors import RequestRejected

# Prompt tokens kept as left context: some tokenizers (SentencePiece) drop a leading space when
# a window is decoded on its own, so each window starts a few tokens earlier.
_CONTEXT_TOKENS = 5


def special_ids(tokenizer) -> frozenset[int]:
    """The ids of a tokenizer's special tokens (its named ones and the added tokens marked
    special), cached on the tokenizer."""
    cached = getattr(tokenizer, "_stepserve_special_ids", None)
    if cached is not None:
        return cached
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(token_id)
    found = frozenset(ids)
    try:
        tokenizer._stepserve_special_ids = found
    except AttributeError:  # pragma: no cover - a tokenizer that refuses attributes
        pass
    return found


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding the whole
    sequence each step, and finds stop strings. Text that could still be the start of a stop
    string is held back until it cannot."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        # with special tokens kept, the special token ids: one that ends the output (EOS, a
        # stop token) is not decoded (replica/engine/output_processor.py)
        self.hidden: frozenset[int] = frozenset() if skip_special_tokens else special_ids(tokenizer)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all output text decoded so far (after stop truncation)
        self._emitted = 0  # chars of self.text already returned to the caller
        self.stop_string: str | None = None

    @classmethod
    def for_request(cls, tokenizer, prompt_token_ids, params) -> IncrementalDetokenizer:
        """The detokenizer of a request with these prompt ids and SamplingParams (its stop
        strings and special-token setting)."""
        return cls(
            tokenizer,
            list(prompt_token_ids),
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> int:
        """Decode new tokens; stops decoding after a stop string is found. Returns how many of
        `token_ids` were taken: all, or those up to the one that completed a stop string."""
        for taken, token_id in enumerate(token_ids):
            if self.stop_string is not None:
                return taken
            self._ids.append(token_id)
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            if new_text.endswith("\ufffd"):
                continue  # an incomplete UTF-8 sequence: wait for the next token
            # The prompt's last tokens can end inside a character (decoded alone, U+FFFD); an
            # output token that completes it yields that character, as a decode of the whole
            # sequence shows it (tokenizers' DecodeStream, vLLM V1), not nothing until a later
            # character comes.
            if len(new_text) > len(prefix_text) and new_text.startswith(prefix_text):
                delta = new_text[len(prefix_text) :]  # the usual case
            else:
                common = len(os.path.commonprefix([prefix_text, new_text]))
                replaced = prefix_text[common:]
                if replaced and replaced.strip("\ufffd") == "" and len(new_text) > common:
                    delta = new_text[common:]  # completes what decoded alone as U+FFFD
                elif len(new_text) <= len(prefix_text):
                    continue  # nothing printable yet (a skipped special token, a merge)
                else:
                    delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._append(delta)
        return len(token_ids)

    def resume(self, token_ids: list[int], text_sent: str) -> int:
        """Replay a resumed request's output (migration) so decoding and the stop-string search
        continue where the lost replica's were, the next delta starting right after
        `text_sent`, the text its client has (shorter than the decode when that replica held
        text back: an incomplete character, a possible stop string's start). Returns how many
        resumed tokens follow a stop string found among them (the request ends there)."""
        taken = self.add_tokens(token_ids)
        if not self.text.startswith(text_sent):
            at = len(os.path.commonprefix([self.text, text_sent]))
            raise RequestRejected(
                f"resumed output_text differs from the decode of output_token_ids at "
                f"character {at} (text {text_sent[at : at + 20]!r}, decode "
                f"{self.text[at : at + 20]!r})",
                "resume",
            )
        self._emitted = len(text_sent)
        return len(token_ids) - taken

    def _append(self, delta: str) -> None:
        start = max(0, len(self.text) - self._holdback)
        self.text += delta
        if not self.stop:
            return
        for stop in self.stop:
            idx = self.text.find(stop, start)
            if idx != -1:
                end = idx + len(stop) if self.include_stop else idx
                self.text = self.text[:end]
                self.stop_string = stop
                return

    def take_delta(self, finished: bool) -> str:
        """The text not yet returned; while unfinished, keep back what may begin a stop string."""
        limit = len(self.text)
        if not finished and self.stop_string is None and self._holdback:
            limit = max(self._emitted, limit - self._holdback)
        delta = self.text[self._emitted : limit]
        self._emitted = limit
        return delta
