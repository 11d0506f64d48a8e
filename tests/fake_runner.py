"""A deterministic stand-in for the model runner (a Runner, runner_protocol.py), for scheduler
and engine tests.

It keeps a simulated KV cache (one fingerprint of the token prefix per slot), checks every
step's token ranges and block tables against it, and samples a token that depends only on the
tokens so far, so a preempted-and-resumed request produces exactly what it would have alone.
"""

from __future__ import annotations

from collections.abc import Collection

from replica.request import EngineDeadError, SamplingParams
from replica.runner_protocol import RunnerOutput
from replica.scheduler import SchedulerOutput

_MODULUS = (1 << 61) - 1
_MULTIPLIER = 1_000_003


class RunnerCheckError(AssertionError):
    """The scheduler handed the runner a step that a real runner could not execute correctly."""


def extend_fingerprints(fingerprints: list[int], tokens: list[int]) -> list[int]:
    """Grow `fingerprints` so that fingerprints[p] identifies tokens[: p + 1] (a rolling hash)."""
    fp = fingerprints[-1] if fingerprints else 0
    for token in tokens[len(fingerprints) :]:
        fp = (fp * _MULTIPLIER + token + 1) % _MODULUS
        fingerprints.append(fp)
    return fingerprints


def token_after(fingerprint: int, vocab_size: int) -> int:
    """The token the fake model samples after a prefix with this fingerprint."""
    return (fingerprint >> 7) % vocab_size


class FakeRunner:
    """Executes SchedulerOutputs against a simulated paged KV cache.

    Per scheduled request it checks that the chunk starts where the request's computation
    stopped (or, for an admitted or resumed request, at a block boundary whose cached blocks
    really hold that prefix), that the block table covers exactly the slots needed, that every
    slot the chunk attends to holds the right prefix, and that no two requests of a step write
    the same slot. `forced_tokens[request_id][k]` overrides the k-th output token.
    """

    def __init__(
        self,
        block_size: int,
        vocab_size: int = 1000,
        forced_tokens: dict[str, list[int]] | None = None,
        num_kv_blocks: int = 1024,
        max_model_len: int = 4096,
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.is_shut_down = False
        self.startup_s: dict[str, float] = {}
        self.forced_tokens = forced_tokens or {}
        self.kv_slots: dict[int, list[int | None]] = {}
        self.num_computed: dict[str, int] = {}
        self._fingerprints: dict[str, list[int]] = {}
        self.num_steps = 0
        self.num_tokens_run = 0
        self.num_draft_tokens = 0
        self._drafted: set[str] = set()

    def _sample(self, request_id: str, num_output_tokens: int, fingerprint: int) -> int:
        forced = self.forced_tokens.get(request_id)
        if forced is not None and num_output_tokens < len(forced):
            return forced[num_output_tokens]
        return token_after(fingerprint, self.vocab_size)

    def check_health(self) -> None:
        if self.is_shut_down:
            raise EngineDeadError("the fake runner is shut down")

    def shutdown(self) -> None:
        self.is_shut_down = True

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step; sample a token for each chunk that reaches the end."""
        self.check_health()
        for rid in scheduler_output.finished_request_ids:
            self.num_computed.pop(rid, None)
            self._fingerprints.pop(rid, None)
            self._drafted.discard(rid)
        for rid in scheduler_output.preempted_request_ids:
            self.num_computed.pop(rid, None)
        bs = self.block_size
        written: set[tuple[int, int]] = set()
        sampled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        total = 0
        for sched in scheduler_output.scheduled:
            request = sched.request
            rid = request.request_id
            start, n = sched.start, sched.num_tokens
            end = start + n
            draft = list(sched.draft)
            if n < 1 or end - len(draft) > request.num_tokens:
                raise RunnerCheckError(
                    f"{rid}: chunk [{start}, {end}) outside its {request.num_tokens} tokens"
                )
            previous = self.num_computed.get(rid)
            if previous is not None and start != previous:
                raise RunnerCheckError(f"{rid}: chunk starts at {start}, computed {previous}")
            if previous is None and start % bs:
                raise RunnerCheckError(
                    f"{rid}: prefix-cache hit of {start} tokens is not whole blocks"
                )
            block_ids = list(sched.block_ids)
            needed = -(-end // bs)
            # a request that drafted may keep blocks its rejected draft tokens had taken
            extra_ok = rid in self._drafted and len(block_ids) > needed
            if len(block_ids) != needed and not extra_ok:
                raise RunnerCheckError(
                    f"{rid}: {len(block_ids)} blocks for {end} tokens of block size {bs} "
                    f"(need exactly {needed})"
                )
            if len(set(block_ids)) != len(block_ids):
                raise RunnerCheckError(f"{rid}: a block appears twice in {block_ids}")
            fps = extend_fingerprints(self._fingerprints.setdefault(rid, []), request.all_token_ids)
            if draft:
                if end - len(draft) != request.num_tokens or n != len(draft) + 1:
                    raise RunnerCheckError(f"{rid}: a draft must follow exactly the last token")
                # the draft positions' slots hold the drafted sequence's prefixes
                fps = extend_fingerprints(list(fps), request.all_token_ids + draft)
            # attention reads every earlier slot: it must hold this request's own prefix
            for b in range(-(-start // bs)):
                lo, hi = b * bs, min((b + 1) * bs, start)
                slots = self.kv_slots.get(block_ids[b])
                if slots is None or slots[: hi - lo] != fps[lo:hi]:
                    raise RunnerCheckError(
                        f"{rid}: block {block_ids[b]} does not hold tokens [{lo}, {hi})"
                    )
            for pos in range(start, end):
                block_id = block_ids[pos // bs]
                slot = (block_id, pos % bs)
                if slot in written:
                    raise RunnerCheckError(f"{rid}: slot {slot} written twice in one step")
                written.add(slot)
                self.kv_slots.setdefault(block_id, [None] * bs)[pos % bs] = fps[pos]
            self.num_computed[rid] = end
            total += n
            if draft:
                # greedy verification: the fake model's token at each position, while the
                # draft agrees; the slots after the last accepted position are stale
                tokens = []
                for i in range(len(draft) + 1):
                    pos = request.num_tokens - 1 + i
                    tokens.append(self._sample(rid, request.num_output_tokens + i, fps[pos]))
                    if i == len(draft) or tokens[-1] != draft[i]:
                        break
                spec_tokens[rid] = tokens
                self._drafted.add(rid)
                sampled[rid] = tokens[0]
                self.num_computed[rid] = request.num_tokens + len(tokens) - 1
                self.num_draft_tokens += len(draft)
            elif sched.sample:
                sampled[rid] = self._sample(rid, request.num_output_tokens, fps[end - 1])
        if total != scheduler_output.total_num_scheduled_tokens:
            raise RunnerCheckError(
                f"total_num_scheduled_tokens={scheduler_output.total_num_scheduled_tokens}, "
                f"chunks add up to {total}"
            )
        self.num_steps += 1
        self.num_tokens_run += total
        return RunnerOutput(sampled, spec_tokens=spec_tokens or None)

    def generate_alone(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: Collection[int],
        max_model_len: int,
    ) -> tuple[list[int], str]:
        """Tokens and finish reason of the request run by itself, one token at a time."""
        tokens = list(prompt_token_ids)
        max_total = min(len(tokens) + params.max_tokens, max_model_len)
        fps: list[int] = []
        outputs: list[int] = []
        while True:
            extend_fingerprints(fps, tokens)
            token = self._sample(request_id, len(outputs), fps[-1])
            tokens.append(token)
            outputs.append(token)
            if not params.ignore_eos and token in eos_token_ids:
                return outputs, "stop"
            if token in params.stop_token_ids:
                return outputs, "stop"
            if len(tokens) >= max_total:
                return outputs, "length"
