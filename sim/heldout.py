"""Held-out traces for the fidelity report (bench/sim_fidelity.py): three traces unlike the data
a profile is fitted on, in the two public layouts, at three loads relative to the capacity of
the cluster they run on (light, ~60% and ~90%), each with its own prompt/output mix. A trace is
made for a rate (`HeldOutTrace.write`); the load decides the rate once the capacity of that mix
is known (bench/sim_fidelity.py measures it on the real cluster)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sim.workloads import azure_rows, mooncake_rows, write_azure_trace, write_mooncake_trace


@dataclass(frozen=True)
class HeldOutTrace:
    name: str
    layout: str  # "azure" (CSV) or "mooncake" (JSONL)
    load: float  # the rate as a share of the mix's capacity
    num_requests: int
    # (rng, n, rate) -> rows in the layout
    rows: Callable[[random.Random, int, float], list]
    about: str

    @property
    def suffix(self) -> str:
        return ".csv" if self.layout == "azure" else ".jsonl"

    def write(self, path: str | Path, rate: float, seed: int = 0, n: int | None = None) -> Path:
        """The trace at `rate` requests/s (its `num_requests`, or `n`) in its layout."""
        path = Path(path)
        rows = self.rows(random.Random(seed), n or self.num_requests, rate)
        if self.layout == "azure":
            write_azure_trace(path, rows)
        else:
            write_mooncake_trace(path, rows)
        return path


def _chat(rng: random.Random, n: int, rate: float) -> list:
    return azure_rows(rng, n, rate, 250, 40, 1500, 200, sigma=(0.9, 0.8))


def _documents(rng: random.Random, n: int, rate: float) -> list:
    # long prompts, short answers, bursty arrivals (gamma shape 0.5)
    return azure_rows(rng, n, rate, 600, 20, 1800, 64, sigma=(0.5, 0.5), burstiness=0.5)


def _shared(rng: random.Random, n: int, rate: float) -> list:
    # 8 shared documents of 1-2 blocks (Zipf-popular), 16-400 tokens of each request's own
    return mooncake_rows(rng, n, rate, 8, (1, 2), (16, 400), 64, 256)


def _chat_tiny(rng: random.Random, n: int, rate: float) -> list:
    return azure_rows(rng, n, rate, 120, 24, 600, 96, sigma=(0.8, 0.7))


def _documents_tiny(rng: random.Random, n: int, rate: float) -> list:
    return azure_rows(rng, n, rate, 400, 12, 900, 32, sigma=(0.4, 0.5), burstiness=0.5)


def _shared_tiny(rng: random.Random, n: int, rate: float) -> list:
    return mooncake_rows(rng, n, rate, 4, (1, 1), (16, 200), 24, 96)


HELDOUT = (
    HeldOutTrace(
        "azure-chat-light", "azure", 0.3, 100, _chat,
        "Azure layout, Poisson, chat mix: prompts log-normal ~250 tokens, outputs ~40",
    ),
    HeldOutTrace(
        "azure-docs-60", "azure", 0.6, 120, _documents,
        "Azure layout, bursty (gamma 0.5), documents: prompts ~600 tokens, outputs ~20",
    ),
    HeldOutTrace(
        "mooncake-shared-90", "mooncake", 0.9, 150, _shared,
        "Mooncake layout, Poisson, 8 shared 1-2 block documents + 16-400 own tokens, outputs ~64",
    ),
)  # fmt: skip

# --quick: the same kinds of trace, short and sized for the tiny model
QUICK = (
    HeldOutTrace("azure-chat-light", "azure", 0.3, 24, _chat_tiny, "quick: chat mix"),
    HeldOutTrace("azure-docs-60", "azure", 0.6, 30, _documents_tiny, "quick: documents"),
    HeldOutTrace("mooncake-shared-90", "mooncake", 0.9, 36, _shared_tiny, "quick: shared docs"),
)
