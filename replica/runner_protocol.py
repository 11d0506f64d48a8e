"""The Runner protocol: exactly what the engine calls on a model runner (ModelRunner in-process,
TensorParallelRunner over a group, the tests' FakeRunner), and RunnerOutput, what a step yields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from replica.scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    """One step's sampled tokens: made by Runner.execute, read by Scheduler.update_from_output."""

    sampled: dict[str, int]  # per request whose scheduled chunk reached its end
    # per sampled request that asked for logprobs: (sampled token's logprob, top-k dict)
    logprobs: dict[str, tuple[float, dict[int, float]]] | None = None
    # per request that wants prompt logprobs and ran prompt positions this step: (index of the
    # first entry, [(logprob of the next prompt token, top-k dict)]) (Request.prompt_logprobs)
    prompt_logprobs: dict[str, tuple[int, list[tuple[float, dict[int, float]]]]] | None = None
    # per request that ran a draft (ScheduledRequest.draft): its new tokens, the accepted draft
    # tokens then the model's own; `sampled` holds the first of them
    spec_tokens: dict[str, list[int]] | None = None
    # per pooling request (embeddings) that ran rows this step: their final hidden states'
    # float32 sum (replica/pooling.py pool_rows)
    pooled: dict | None = None
    # the step as it ran when requests joined it under way (Runner.execute's `join`): the
    # scheduled step's requests, then the joined ones; None when none joined
    step: SchedulerOutput | None = None


@runtime_checkable
class Runner(Protocol):
    """A model runner as the engine sees it; the engine calls nothing else on it."""

    @property
    def max_model_len(self) -> int:
        """The longest context (prompt + output) a request may reach."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold are 0..vocab_size-1."""
        ...

    @property
    def num_kv_blocks(self) -> int:
        """KV cache blocks the scheduler may hand out (ids 0..num_kv_blocks-1)."""
        ...

    @property
    def startup_s(self) -> dict[str, float]:
        """Wall seconds of the runner's start by phase (empty when it does not time them)."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step; sample where a request's chunk reaches its end. A runner
        whose `can_join` is true also takes `join`: a callable of the layer index that may
        return requests (a SchedulerOutput) to join the step at that layer."""
        ...

    def check_health(self) -> None:
        """Raise (EngineDeadError) when the runner can no longer run steps."""
        ...

    def shutdown(self) -> None:
        """Release the runner's resources (idempotent; it is unusable afterwards)."""
        ...
