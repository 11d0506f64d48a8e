"""The one check of a request against the engine that is to serve it: what the engine's shape
(context length, vocabulary, KV cache, scheduling policy) can never serve. The ingress runs it
before routing (with the limits a replica reports, `model_info`), the engine before queueing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from replica.errors import RequestRejected
from replica.pooling import check_pooling
from replica.sampling_params import SamplingParams

if TYPE_CHECKING:
    from replica.request import PoolingRequest, Resume


@dataclass(frozen=True)
class EngineLimits:
    """An engine's limits. `scheduling_policy` None: unknown, the priority check is skipped."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    scheduling_policy: str | None = None

    @classmethod
    def from_model_info(cls, info: Mapping, scheduling_policy: str | None = None) -> EngineLimits:
        """The limits in a replica's `model_info()` answer; `scheduling_policy` stands in for
        that key when the answer lacks it."""
        return cls(
            max_model_len=info["max_model_len"],
            vocab_size=info["vocab_size"],
            num_kv_blocks=info["num_kv_blocks"],
            block_size=info["block_size"],
            scheduling_policy=info.get("scheduling_policy", scheduling_policy),
        )

    def check(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        resume: Resume | None = None,
        pooling: PoolingRequest | None = None,
    ) -> None:
        """Raise RequestRejected, `param` naming the field at fault, for a request this engine
        can never serve. The ingress runs its parts in its own order (router/ingress_core.py,
        router/embeddings.py). A pooling request generates nothing: its prompt may fill
        max_model_len, and its sampling parameters are not read."""
        if pooling is not None:
            check_pooling(pooling)
            self.check_prompt(prompt_token_ids)
            self.check_pooling_length(len(prompt_token_ids))
            self.check_blocks(len(prompt_token_ids), 0)
            return
        self.check_prompt(prompt_token_ids)
        self.check_length(len(prompt_token_ids))
        self.check_request(len(prompt_token_ids), params, priority)
        if resume is not None:
            self.check_resume(len(prompt_token_ids), params, resume)

    def check_resume(self, num_prompt_tokens: int, params: SamplingParams, resume: Resume) -> None:
        """A resumed request's output (migration: request.Resume) within max_tokens and,
        with the prompt, within max_model_len, each token in the vocabulary: a resume that
        reaches either limit exactly ends at once ("length")."""
        num_output = len(resume.output_token_ids)
        if num_output > params.max_tokens:
            raise RequestRejected(
                f"resumed output has {num_output} tokens, more than max_tokens={params.max_tokens}",
                "resume",
            )
        if num_prompt_tokens + num_output > self.max_model_len:
            raise RequestRejected(
                f"prompt ({num_prompt_tokens} tokens) + resumed output ({num_output} tokens) = "
                f"{num_prompt_tokens + num_output} tokens, over max_model_len="
                f"{self.max_model_len}",
                "resume",
            )
        vocab = self.vocab_size
        bad = next((i for i, t in enumerate(resume.output_token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(
                f"resumed output token {bad} (id {resume.output_token_ids[bad]}) is outside "
                f"the vocabulary [0, {vocab})",
                "resume",
            )

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        """A prompt of at least one token, each in the vocabulary."""
        if not prompt_token_ids:
            raise RequestRejected("prompt must contain at least one token", "prompt")
        vocab = self.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(
                f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt"
            )

    def check_length(self, num_prompt_tokens: int) -> None:
        """The prompt and one output token within max_model_len."""
        if num_prompt_tokens + 1 > self.max_model_len:
            raise RequestRejected(
                f"prompt has {num_prompt_tokens} tokens, which leaves no room to generate "
                f"within max_model_len={self.max_model_len}",
                "prompt",
            )

    def check_pooling_length(self, num_prompt_tokens: int, index: int | None = None) -> None:
        """A pooling (embeddings) request's prompt within max_model_len: nothing is generated,
        so it may fill it. `index`: the input's place in its request, named in the error."""
        if num_prompt_tokens > self.max_model_len:
            which = "input" if index is None else f"input {index}"
            raise RequestRejected(
                f"{which} has {num_prompt_tokens} tokens, over max_model_len={self.max_model_len}",
                "input",
            )

    def check_request(self, num_prompt_tokens: int, params: SamplingParams, priority: int) -> None:
        """What the sampling parameters ask of this engine: the scheduling policy for a
        priority, the KV blocks for max_tokens, logit_bias's tokens in the vocabulary."""
        if priority != 0 and self.scheduling_policy not in (None, "priority"):
            raise RequestRejected(
                f"priority={priority} needs scheduling_policy='priority' (this replica runs "
                f"{self.scheduling_policy!r})",
                "priority",
            )
        self.check_blocks(num_prompt_tokens, params.max_tokens)
        if params.logit_bias:
            bad = next((t for t in params.logit_bias if t >= self.vocab_size), None)
            if bad is not None:
                raise RequestRejected(
                    f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                    "logit_bias",
                )

    def check_blocks(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """The longest the request may grow to, min(prompt + max_tokens, max_model_len),
        within the KV cache."""
        max_total = min(num_prompt_tokens + max_tokens, self.max_model_len)
        blocks = -(-max_total // self.block_size)
        if blocks > self.num_kv_blocks:
            raise RequestRejected(
                f"request needs up to {max_total} tokens = {blocks} KV blocks of "
                f"{self.block_size}, but the whole KV cache has {self.num_kv_blocks} blocks",
                "max_tokens",
            )

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """check_length and check_blocks: a request of this shape can complete (the
        scheduler's check, which sees lengths only)."""
        self.check_length(num_prompt_tokens)
        self.check_blocks(num_prompt_tokens, max_tokens)


def check_fits(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int, num_blocks: int
) -> None:
    """EngineLimits.check_fits for a holder of the lengths alone (the scheduler: its own
    invariant, a request that can never complete would wait forever)."""
    EngineLimits(max_model_len, 0, num_blocks, block_size).check_fits(num_prompt_tokens, max_tokens)
