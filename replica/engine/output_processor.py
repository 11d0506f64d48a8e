"""Detokenization and stop strings: turns an engine's token deltas into text deltas."""

from __future__ import annotations

from collections.abc import Sequence

from replica.detokenizer import IncrementalDetokenizer
from replica.request import RequestOutput, Resume, SamplingParams


class OutputProcessor:
    """Detokenization and stop strings of an engine's requests: turns the engine's token deltas
    into text deltas. In-process (Engine with detokenize=True) it runs on the engine's thread;
    with the engine core in its own process (engine/core_process.py) it runs in the front, and
    a stop string found there is sent to the core as a finish."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # or a LazyTokenizer, resolved at the first request
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        # resumed requests whose resumed output holds a stop string: the tokens after it
        # (the request ends at its first output, as it would have on the lost replica)
        self._past_stop: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._detoks)

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        resume: Resume | None = None,
    ) -> None:
        """Hold a request's detokenizer; a resumed one's is primed with its resumed output
        (RequestRejected when `resume.output_text` is not what those tokens decode to)."""
        from replica.tokenizer import loaded

        detok = IncrementalDetokenizer.for_request(loaded(self.tokenizer), prompt_token_ids, params)
        if resume is not None:
            past_stop = detok.resume(list(resume.output_token_ids), resume.output_text)
            if past_stop:
                self._past_stop[request_id] = past_stop
        self._detoks[request_id] = detok

    def drop(self, request_id: str) -> None:
        self._detoks.pop(request_id, None)
        self._past_stop.pop(request_id, None)

    def process(self, out: RequestOutput) -> tuple[RequestOutput | None, bool]:
        """`out` with its text delta filled in, and whether a stop string ended it here (the
        engine must then finish the request); None for a request this processor does not
        hold (finished or dropped: a delta the engine made before it heard of the end)."""
        detok = self._detoks.get(out.request_id)
        if detok is None:
            return None, False
        ids = out.new_token_ids
        if (
            detok.hidden
            and out.finish_reason == "stop"
            and not isinstance(out.stop_reason, str)
            and ids
            and ids[-1] in detok.hidden
        ):
            # special tokens kept: the token that stopped the output (EOS, a stop token id)
            # is not text (a stop string's end is found by the detokenizer, before it)
            taken = detok.add_tokens(ids[:-1])
            taken += taken == len(ids) - 1 and detok.stop_string is None
        else:
            taken = detok.add_tokens(ids)
        # the engine must finish the request when the stop string ended it here
        stopped = out.finish_reason is None and detok.stop_string is not None
        # tokens past the stop string: of this delta, and of a resumed output holding one
        dropped = len(out.new_token_ids) - taken + self._past_stop.pop(out.request_id, 0)
        if stopped or (dropped > 0 and detok.stop_string is not None):
            # a delta of several tokens (accepted draft tokens) may go past the token that
            # completed the stop string, even past one that ended the request (max_tokens,
            # EOS): the output ends at the stop string, as with one token a step
            out.finish_reason, out.stop_reason = "stop", detok.stop_string
            if dropped > 0:
                out.new_token_ids = out.new_token_ids[:taken]
                out.num_output_tokens -= dropped
                if out.new_logprobs is not None:
                    out.new_logprobs = out.new_logprobs[:taken]
        out.new_text = detok.take_delta(finished=out.finished)
        if out.finished:  # pop: the caller's thread may have dropped it meanwhile (an abort)
            self._detoks.pop(out.request_id, None)
            self._past_stop.pop(out.request_id, None)
        return out, stopped
