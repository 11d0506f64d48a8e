"""Which requests have sampled tokens but shown their client no text yet.

A byte-level token can be part of a character (a piece of a CJK character or of full-width
punctuation): alone it decodes to nothing, and the client's first text waits for the token
that completes it. The engine core does not detokenize (its front does), so it keeps its own
IncrementalDetokenizer, the front's code on the same tokenizer, for each request only from its
first output token until its first text (or MAX_PENDING_TOKENS tokens), and sets
`Request.text_pending` for the scheduler (EngineConfig.first_text_priority: the step that
brings a client its first text runs no prompt)."""

from __future__ import annotations

from replica.detokenizer import IncrementalDetokenizer
from replica.request import Request

# a UTF-8 character is at most 4 bytes and a byte-level token at least one: a request whose
# first 4 tokens show nothing (special tokens alone, a stop string's possible start held
# back) is no longer watched, so a hold it causes is bounded
MAX_PENDING_TOKENS = 4


class FirstTextWatch:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer  # or a LazyTokenizer: nothing is watched until it is loaded
        self._detoks: dict[str, IncrementalDetokenizer] = {}

    @property
    def ready(self) -> bool:
        """The tokenizer is loaded. The engine core's is loaded after its first idle heartbeat
        (with the grammar engine's vocabulary, core_process.py), not on the stepping thread."""
        from replica.tokenizer import LazyTokenizer

        tokenizer = self._tokenizer
        return tokenizer.loaded if isinstance(tokenizer, LazyTokenizer) else True

    def __len__(self) -> int:
        return len(self._detoks)

    def observe(self, request: Request, new_token_ids: list[int]) -> None:
        """After a step gave `request` its `new_token_ids` (request.output_token_ids has
        them): set request.text_pending to whether its client has seen no text yet."""
        rid = request.request_id
        detok = self._detoks.get(rid)
        if detok is None:
            num_before = request.num_output_tokens - len(new_token_ids)
            if (
                num_before > 0  # first text already due before (or a resumed request)
                or not new_token_ids
                or request.pooling is not None
                or request.is_finished
                or not self.ready
            ):
                request.text_pending = False
                return
            from replica.tokenizer import loaded

            detok = IncrementalDetokenizer.for_request(
                loaded(self._tokenizer), request.prompt_token_ids, request.sampling_params
            )
            self._detoks[rid] = detok
        detok.add_tokens(new_token_ids)
        pending = (
            not detok.take_delta(finished=False)
            and detok.stop_string is None
            and request.num_output_tokens < MAX_PENDING_TOKENS
            and not request.is_finished
        )
        request.text_pending = pending
        if not pending:
            del self._detoks[rid]

    def forget(self, request_id: str) -> None:
        self._detoks.pop(request_id, None)
