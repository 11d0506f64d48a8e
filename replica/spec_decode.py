"""Speculative decoding by prompt lookup (n-gram drafts), for plain greedy requests.

Each decode step, the scheduler asks the proposer for a draft: the trailing n tokens of the
request (prompt + output, n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked up
earlier in the same sequence, and the tokens that followed their latest earlier occurrence are
the draft. The step then runs the request's last token and the draft together; the runner
takes the argmax at each of those positions and keeps the draft's longest prefix that matches,
plus the token the model chose after it (so a step always yields at least one token, and the
tokens are those greedy decoding produces one step at a time, up to floating-point: the
positions run through the multi-token attention path, as a chunked prefill's do, so an argmax
within rounding of a tie could flip; greedy fp32 is token-identical to transformers on the test
checkpoints, tests/replica/test_spec_decode.py). The KV
written for rejected draft positions sits past the request's computed tokens and is
overwritten when those positions are computed for real; prefix-cache blocks only ever hash
real tokens.

The lookup is an index per request, extended incrementally as tokens arrive (O(n-range) per
token), not a scan of the sequence. The draft length adapts per request: it grows after a
fully accepted draft and shrinks to what was accepted otherwise, so a request whose text does
not repeat stops paying for drafts (it still probes with one token when an n-gram matches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from replica.request import Request, SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["NgramProposer", "SpecStats", "speculation_allowed"]


def speculation_allowed(params: SamplingParams) -> bool:
    """Whether a request's tokens can be verified by argmax alone: greedy, and nothing that
    changes the logits per position (penalties, bias, min_tokens, a grammar) or asks for
    per-token logprobs."""
    return (
        params.temperature == 0.0
        and params.structured is None
        and params.logprobs is None
        and params.prompt_logprobs is None
        and not params.logit_bias
        and params.min_tokens == 0
        and not params.uses_penalties
    )


@dataclass
class SpecStats:
    """Counters since start (vLLM reports the same three)."""

    num_drafts: int = 0  # verification steps that carried a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class _RequestIndex:
    """One request's n-gram index: for each n, the n-gram -> the position just after its latest
    occurrence among the positions indexed so far."""

    maps: list[dict[tuple[int, ...], int]]
    indexed_upto: int = 0  # n-grams ending at positions <= this are in the maps
    draft_len: int = 0  # adaptive: tokens to draft next time
    last_draft: list[int] = field(default_factory=list)


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_max: int, lookup_min: int) -> None:
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({lookup_min}) must be >= 1 and <= prompt_lookup_max "
                f"({lookup_max})"
            )
        self.k = num_speculative_tokens
        self.lookup_max = lookup_max
        self.lookup_min = lookup_min
        self.stats = SpecStats()
        self._index: dict[str, _RequestIndex] = {}

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    def num_tracked(self) -> int:
        return len(self._index)

    def propose(self, request: Request, max_len: int) -> list[int]:
        """Up to min(max_len, the request's adaptive length) draft tokens, or [] when no
        trailing n-gram occurred before."""
        if max_len <= 0:
            return []
        state = self._index.get(request.request_id)
        if state is None:
            state = _RequestIndex([{} for _ in range(self.lookup_min, self.lookup_max + 1)])
            state.draft_len = self.k
            self._index[request.request_id] = state
        tokens = request.all_token_ids
        end = len(tokens)
        self._extend(state, tokens, end - 1)
        want = min(max_len, max(state.draft_len, 1))
        for n in range(self.lookup_max, self.lookup_min - 1, -1):
            if end <= n:
                continue
            pos = state.maps[n - self.lookup_min].get(tuple(tokens[end - n :]))
            if pos is not None:
                draft = tokens[pos : pos + want]
                state.last_draft = draft
                return draft
        state.last_draft = []
        return []

    def _extend(self, state: _RequestIndex, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending at positions indexed_upto+1 .. upto (a position p is the
        index just after the n-gram's last token)."""
        lo = self.lookup_min
        for p in range(state.indexed_upto + 1, upto + 1):
            for n in range(lo, min(self.lookup_max, p) + 1):
                state.maps[n - lo][tuple(tokens[p - n : p])] = p
        state.indexed_upto = max(state.indexed_upto, upto)

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """A verification's outcome: counters, and the request's next draft length."""
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafted
        self.stats.num_accepted_tokens += num_accepted
        state = self._index.get(request_id)
        if state is None:
            return
        if num_accepted == num_drafted:
            state.draft_len = min(self.k, state.draft_len + 1)
        else:
            state.draft_len = max(1, num_accepted)


def verify_greedy_drafts(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    """Greedy verification of drafts: `logits` holds, per draft in order, the rows of its
    request's last token and of each draft token. A request's new tokens are the longest
    prefix of its draft that matches the argmax at each position, then the argmax after it
    (the sampler's greedy choice: argmax of fp32 logits, first index on ties)."""
    from replica.layers.sampler import greedy_tokens

    chosen = greedy_tokens(logits.float()).tolist()
    out = []
    offset = 0
    for draft in drafts:
        row = chosen[offset : offset + len(draft) + 1]
        offset += len(draft) + 1
        accepted = 0
        while accepted < len(draft) and row[accepted] == draft[accepted]:
            accepted += 1
        out.append(draft[:accepted] + [row[accepted]])
    return out
