"""Workloads for the load generator (bench/serving.py) and the simulator (sim/cluster.py): token-id
datasets, arrival processes, multi-turn conversations, and trace files in two public layouts:

- Azure LLM inference traces (CSV: TIMESTAMP, ContextTokens, GeneratedTokens);
- Mooncake traces (JSONL: timestamp in ms, input_length, output_length, hash_ids: one id per
  512-token block, equal ids meaning equal blocks).

Any of them can name LoRA adapters (`assign_adapters`: a request or conversation runs with one
of N adapters, drawn with Zipf popularity); by default none does.

A small generated sample of each is in sim/traces/ (`python -m sim.workloads --write-samples`).
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

# Token ids drawn for prompts: above the tiny tokenizer's specials (0-2), inside every vocab
# we serve (the tiny one has 512 ids).
DEFAULT_TOKEN_RANGE = (10, 500)


# -- datasets -----------------------------------------------------------------------------------
@dataclass
class RequestSpec:
    """One request to send: its prompt as token ids and how many tokens it must generate."""

    prompt_ids: list[int]
    output_len: int
    kind: str = "random"  # a class label for per-class breakdowns (short / long / prefix-3 ...)
    lora: str | None = None  # the LoRA adapter it runs with (its name); None: the base model

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def release(self) -> None:
        """(Nothing to drop: LazyRequestSpec's counterpart.)"""


class LazyRequestSpec:
    """A RequestSpec whose random prompt is made only when first read and can be dropped again
    (`release`): a 100k-request trace then holds lengths and seeds, not 30M token ids."""

    __slots__ = ("num_prompt_tokens", "output_len", "seed", "kind", "lora", "_ids")

    def __init__(self, num_prompt_tokens: int, output_len: int, seed: int, kind: str = "random"):
        self.num_prompt_tokens = num_prompt_tokens
        self.output_len = output_len
        self.seed = seed
        self.kind = kind
        self.lora: str | None = None
        self._ids: list[int] | None = None

    @property
    def prompt_ids(self) -> list[int]:
        if self._ids is None:
            low, high = DEFAULT_TOKEN_RANGE
            rng = random.Random(self.seed)
            self._ids = [
                low + int(rng.random() * (high - low)) for _ in range(self.num_prompt_tokens)
            ]
        return self._ids

    def release(self) -> None:
        self._ids = None


def lazy_chat_like(
    n: int, input_median: int, output_median: int, input_max: int, output_max: int, seed: int
) -> list[LazyRequestSpec]:
    """`chat_like_dataset`'s lengths, prompts made on demand (LazyRequestSpec)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        n_in = int(min(input_max, max(8, rng.lognormvariate(math.log(input_median), 0.8))))
        n_out = int(min(output_max, max(1, rng.lognormvariate(math.log(output_median), 0.7))))
        out.append(LazyRequestSpec(n_in, n_out, seed * 1_000_003 + i, "chat"))
    return out


def _tokens(rng: random.Random, n: int, token_range: tuple[int, int]) -> list[int]:
    low, high = token_range
    return [rng.randrange(low, high) for _ in range(n)]


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def random_dataset(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    rng: random.Random,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
) -> list[RequestSpec]:
    return [
        RequestSpec(
            _tokens(rng, _length(rng, input_len, range_ratio), token_range),
            _length(rng, output_len, range_ratio),
            "random",
        )
        for _ in range(n)
    ]


def prefix_repetition_dataset(
    n: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    rng: random.Random,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
    prefix_rng: random.Random | None = None,
) -> list[RequestSpec]:
    """`num_prefixes` shared prefixes (system prompts, few-shot headers), each request one of
    them (uniformly at random) plus a unique suffix: the prefix cache's best case, if the
    same prefix keeps landing on the replica that has it cached. `prefix_rng` (default `rng`)
    draws the prefixes, so several datasets can share them."""
    prefixes = [_tokens(prefix_rng or rng, prefix_len, token_range) for _ in range(num_prefixes)]
    specs = []
    for _ in range(n):
        which = rng.randrange(num_prefixes)
        prompt = prefixes[which] + _tokens(rng, suffix_len, token_range)
        specs.append(RequestSpec(prompt, output_len, f"prefix-{which}"))
    return specs


def long_tail_dataset(
    n: int,
    input_len: int,
    output_median: int,
    output_max: int,
    sigma: float,
    rng: random.Random,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
) -> list[RequestSpec]:
    """Output lengths log-normal around `output_median`, clipped to [1, output_max]: most
    answers short, a few very long ones (the shape chat traffic has)."""
    specs = []
    for _ in range(n):
        out = int(
            min(output_max, max(1, round(rng.lognormvariate(math.log(output_median), sigma))))
        )
        specs.append(
            RequestSpec(_tokens(rng, _length(rng, input_len, 0.5), token_range), out, "tail")
        )
    return specs


def heterogeneous_dataset(
    n: int,
    long_fraction: float,
    short: tuple[int, int],
    long: tuple[int, int],
    rng: random.Random,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
) -> list[RequestSpec]:
    """Short chat turns mixed with very long prompts and outputs ((input, output) means, +-25%):
    a few long requests hold a replica's seats and KV cache for a long time, so where each
    request lands matters. Exactly round(n * long_fraction) of them are long, at random
    positions, so that datasets of the same size carry the same load."""
    num_long = round(n * long_fraction)
    kinds = [True] * num_long + [False] * (n - num_long)
    rng.shuffle(kinds)
    specs = []
    for is_long in kinds:
        input_len, output_len = long if is_long else short
        specs.append(
            RequestSpec(
                _tokens(rng, _length(rng, input_len, 0.25), token_range),
                _length(rng, output_len, 0.25),
                "long" if is_long else "short",
            )
        )
    return specs


def chat_like_dataset(
    n: int,
    input_median: int,
    output_median: int,
    input_max: int,
    output_max: int,
    rng: random.Random,
    sigma: tuple[float, float] = (0.8, 0.7),
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
) -> list[RequestSpec]:
    """Prompt and output lengths both log-normal (the shape of the Azure chat traces), clipped to
    [8, input_max] and [1, output_max]."""
    specs = []
    for _ in range(n):
        n_in = int(min(input_max, max(8, rng.lognormvariate(math.log(input_median), sigma[0]))))
        n_out = int(min(output_max, max(1, rng.lognormvariate(math.log(output_median), sigma[1]))))
        specs.append(RequestSpec(_tokens(rng, n_in, token_range), n_out, "chat"))
    return specs


# -- LoRA adapters ------------------------------------------------------------------------------
def adapter_name(i: int) -> str:
    """The name of the workloads' adapter number i (its popularity rank, 0 the most popular)."""
    return f"lora-{i}"


def zipf_weights(n: int, skew: float) -> list[float]:
    """Zipf popularity of n items: item i (0-based) is drawn with weight 1 / (i + 1) ** skew
    (skew 0: uniform; about 1: a few adapters take most of the traffic, a long tail the rest)."""
    return [1.0 / (i + 1) ** skew for i in range(n)]


def assign_adapters(items: list, num_adapters: int, skew: float, rng: random.Random) -> list:
    """Give each item (RequestSpec, LazyRequestSpec or Conversation) one of `num_adapters`
    adapters (`adapter_name`), drawn with Zipf popularity `skew`; `items`, for chaining."""
    if num_adapters <= 0:
        return items
    names = [adapter_name(i) for i in range(num_adapters)]
    for item, name in zip(
        items, rng.choices(names, zipf_weights(num_adapters, skew), k=len(items))
    ):
        item.lora = name
    return items


# -- arrivals -----------------------------------------------------------------------------------
def arrival_offsets(
    n: int, request_rate: float, burstiness: float, rng: random.Random
) -> list[float]:
    """Send times (s from the start) of n requests: gamma inter-arrivals with mean 1/rate and
    shape `burstiness` (1 = Poisson). An infinite rate sends everything at once."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate ({request_rate}) and burstiness ({burstiness}) must be > 0")
    scale = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out


# -- multi-turn chat ------------------------------------------------------------------------------
@dataclass
class Turn:
    """One user turn: the user's new tokens, the answer's length and its tokens (the simulator
    generates exactly these; the HTTP client appends the answer the server actually sent), and
    the user's think time before the next turn."""

    user_ids: list[int]
    output_len: int
    answer_ids: list[int]
    think_s: float


@dataclass
class Conversation:
    """A chat: one of a few long system prompts, then turns; turn k's prompt is the system
    prompt and every earlier turn's user tokens and answer, then turn k's user tokens."""

    conversation_id: int
    start_s: float
    system_ids: list[int]
    turns: list[Turn]
    kind: str = "chat"
    lora: str | None = None  # the LoRA adapter every turn runs with; None: the base model

    def prompt(self, k: int, answers: list[list[int]] | None = None) -> list[int]:
        """Turn k's prompt; `answers` (default: the planned ones) are the earlier answers."""
        out = list(self.system_ids)
        for j in range(k):
            out += self.turns[j].user_ids
            out += answers[j] if answers is not None else self.turns[j].answer_ids
        out += self.turns[k].user_ids
        return out

    def spec(self, k: int, answers: list[list[int]] | None = None) -> RequestSpec:
        return RequestSpec(self.prompt(k, answers), self.turns[k].output_len, self.kind, self.lora)


def multi_turn_conversations(
    n: int,
    rate: float,
    rng: random.Random,
    num_system_prompts: int = 4,
    system_len: int = 256,
    user_len: int = 32,
    output_len: int = 32,
    turns: tuple[int, int] = (2, 6),
    think_s: float = 2.0,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
    system_rng: random.Random | None = None,
) -> list[Conversation]:
    """`n` conversations starting as a Poisson process of `rate` per second, each with one of
    `num_system_prompts` system prompts (`system_rng`, default `rng`, draws them, so datasets
    can share them), a uniform number of turns in `turns`, user messages and answers of about
    `user_len` / `output_len` tokens (+-50%), and exponential think times of mean `think_s`."""
    systems = [
        _tokens(system_rng or rng, system_len, token_range) for _ in range(num_system_prompts)
    ]
    starts = arrival_offsets(n, rate, 1.0, rng)
    out = []
    for i, start in enumerate(starts):
        which = rng.randrange(num_system_prompts)
        conv_turns = []
        for _ in range(rng.randint(*turns)):
            out_len = _length(rng, output_len, 0.5)
            conv_turns.append(
                Turn(
                    user_ids=_tokens(rng, _length(rng, user_len, 0.5), token_range),
                    output_len=out_len,
                    answer_ids=_tokens(rng, out_len, token_range),
                    think_s=rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0,
                )
            )
        out.append(Conversation(i, start, systems[which], conv_turns, f"system-{which}"))
    return out


def oracle_hit_tokens(
    requests: list[tuple[float, list[int], float | None, list[int] | None]],
    block_size: int,
    roots: list[int] | None = None,
) -> list[int]:
    """Per request (arrival time, prompt, finish time or None, generated tokens or None), the
    prompt tokens one cache holding every block ever computed would have had: its prompt's
    leading full blocks that an earlier request's prompt (computed by the time it arrives) or a
    finished request's prompt and answer already held, at most (len - 1) // block_size blocks
    (the last token is always computed), as a replica's cache counts them. `roots`: each
    request's block-hash root (`root_block_hash` of its adapter; default the base model's)."""
    from replica.request import ROOT_BLOCK_HASH, extend_block_hashes

    roots = roots or [ROOT_BLOCK_HASH] * len(requests)

    events = []
    for i, (arrival, _, finished, answer) in enumerate(requests):
        events.append((arrival, 1, i))
        if finished is not None and answer:
            events.append((finished, 0, i))
    events.sort()
    seen: set[int] = set()
    hits = [0] * len(requests)
    for _, kind, i in events:
        _, prompt, _, answer = requests[i]
        if kind == 1:
            usable = (len(prompt) - 1) // block_size * block_size
            n = 0
            for h in extend_block_hashes([], prompt[:usable], block_size, roots[i]):
                if h not in seen:
                    break
                n += block_size
            hits[i] = n
            seen.update(extend_block_hashes([], prompt, block_size, roots[i]))
        else:
            seen.update(extend_block_hashes([], prompt + answer, block_size, roots[i]))
    return hits


# -- traces ---------------------------------------------------------------------------------------
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces


@dataclass
class TraceRequest:
    """One row of a trace: when it arrives (s from the trace's start) and what it asks."""

    arrival_s: float
    spec: RequestSpec


def _block_tokens(hash_id: int, n: int, token_range: tuple[int, int], salt: int = 0) -> list[int]:
    """The tokens of Mooncake block `hash_id` (the same ids for the same block and salt,
    everywhere; another salt gives other tokens with the same sharing)."""
    return _tokens(random.Random(hash_id * 2654435761 + 17 + salt * 1_000_000_007), n, token_range)


def _azure_time(text: str) -> float:
    # "2023-11-16 18:15:46.6805900": at most 6 fractional digits for datetime
    head, _, frac = text.strip().partition(".")
    stamp = datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
    return stamp.timestamp() + (float("0." + frac) if frac else 0.0)


def read_azure_trace(
    path: str | Path,
    seed: int = 0,
    limit: int | None = None,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
) -> list[TraceRequest]:
    """An Azure LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens). Its prompts
    are lengths only: each gets random token ids (seeded), so nothing is shared between
    requests. Times are shifted to start at 0."""
    rng = random.Random(seed)
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append(
                (
                    _azure_time(row["TIMESTAMP"]),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                )
            )
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{path}: no rows (expected TIMESTAMP,ContextTokens,GeneratedTokens)")
    t0 = min(r[0] for r in rows)
    return [
        TraceRequest(
            t - t0, RequestSpec(_tokens(rng, max(1, n_in), token_range), max(1, n_out), "azure")
        )
        for t, n_in, n_out in sorted(rows)
    ]


def read_mooncake_trace(
    path: str | Path,
    limit: int | None = None,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
    salt: int = 0,
) -> list[TraceRequest]:
    """A Mooncake trace (JSONL: timestamp ms, input_length, output_length, hash_ids). Block k of
    a prompt is the tokens of hash id k (the last block cut to the input length), so requests
    that share hash ids share those prefix tokens, as in the real trace. `salt` draws other
    tokens for the same blocks (a second replay that must not hit the first one's cache)."""
    out = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            try:
                n_in, n_out = int(row["input_length"]), int(row["output_length"])
                ids = [int(h) for h in row.get("hash_ids", [])]
                t = float(row["timestamp"]) / 1000.0
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: bad Mooncake row ({exc})") from exc
            prompt: list[int] = []
            for h in ids:
                prompt += _block_tokens(h, MOONCAKE_BLOCK_TOKENS, token_range, salt)
            prompt = prompt[:n_in]
            if len(prompt) < n_in:  # rows whose hash ids do not cover the prompt
                filler = random.Random(line_no + salt * 1_000_000_007)
                prompt += _tokens(filler, n_in - len(prompt), token_range)
            out.append(TraceRequest(t, RequestSpec(prompt, max(1, n_out), "mooncake")))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: no rows")
    t0 = min(r.arrival_s for r in out)
    for r in out:
        r.arrival_s -= t0
    return sorted(out, key=lambda r: r.arrival_s)


def read_trace(path: str | Path, limit: int | None = None, seed: int = 0) -> list[TraceRequest]:
    """Either layout, by extension: .csv is Azure's, .jsonl Mooncake's. `seed` draws the
    prompts' token ids (Azure: every prompt's; Mooncake: each hash id's block, as a salt): the
    same lengths, times and sharing for any seed."""
    suffix = Path(path).suffix
    if suffix == ".csv":
        return read_azure_trace(path, seed=seed, limit=limit)
    if suffix == ".jsonl":
        return read_mooncake_trace(path, limit=limit, salt=seed)
    raise ValueError(f"{path}: unknown trace layout {suffix!r} (expected .csv or .jsonl)")


def write_azure_trace(path: str | Path, rows: list[tuple[float, int, int]]) -> None:
    """Rows (seconds from start, prompt tokens, output tokens) in Azure's CSV layout."""
    base = datetime(2023, 11, 16, 18, 0, 0).timestamp()
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for t, n_in, n_out in rows:
            stamp = datetime.fromtimestamp(base + t)
            w.writerow([stamp.strftime("%Y-%m-%d %H:%M:%S.%f") + "0", n_in, n_out])


def write_mooncake_trace(path: str | Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def day_shaped_rates(
    duration_s: float,
    peak_rate: float,
    trough_fraction: float = 0.2,
    bursts: int = 3,
    rng: random.Random | None = None,
) -> list[float]:
    """A per-second request rate over `duration_s` shaped like a compressed day: a trough, a
    smooth rise to `peak_rate`, a fall back, with `bursts` short spikes (2x for a few percent of
    the time) at random moments."""
    rng = rng or random.Random(0)
    n = max(1, int(duration_s))
    rates = []
    for s in range(n):
        phase = s / n
        level = trough_fraction + (1 - trough_fraction) * 0.5 * (1 - math.cos(2 * math.pi * phase))
        rates.append(peak_rate * level)
    width = max(1, n // 50)
    for _ in range(bursts):
        at = rng.randrange(n)
        for s in range(at, min(n, at + width)):
            rates[s] *= 2.0
    return rates


def arrivals_from_rates(rates: list[float], rng: random.Random) -> list[float]:
    """Poisson arrival times under a piecewise-constant rate (one value per second)."""
    out = []
    for second, rate in enumerate(rates):
        if rate <= 0:
            continue
        t = second + rng.expovariate(rate)
        while t < second + 1:
            out.append(t)
            t += rng.expovariate(rate)
    return out


def sample_rows(
    rng: random.Random, n: int = 200, rate: float = 2.0
) -> list[tuple[float, int, int]]:
    """(time, prompt tokens, output tokens) rows shaped like chat traffic: log-normal lengths."""
    times = arrival_offsets(n, rate, 1.0, rng)
    rows = []
    for t in times:
        n_in = int(min(2000, max(8, rng.lognormvariate(math.log(200), 0.8))))
        n_out = int(min(500, max(1, rng.lognormvariate(math.log(60), 0.7))))
        rows.append((t, n_in, n_out))
    return rows


def mooncake_sample_rows(rng: random.Random, n: int = 200, rate: float = 2.0) -> list[dict]:
    """Mooncake-layout rows where a few long documents (hash-id chains) are shared."""
    documents = [list(range(d * 100, d * 100 + rng.randint(2, 6))) for d in range(8)]
    next_id = 10_000
    rows = []
    for t in arrival_offsets(n, rate, 1.0, rng):
        doc = rng.choice(documents)
        shared = doc[: rng.randint(1, len(doc))]
        own = rng.randint(0, 2)
        ids = shared + list(range(next_id, next_id + own + 1))
        next_id += own + 1
        n_in = (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS + rng.randint(1, MOONCAKE_BLOCK_TOKENS)
        rows.append(
            {
                "timestamp": int(t * 1000),
                "input_length": n_in,
                "output_length": int(min(500, max(1, rng.lognormvariate(math.log(40), 0.6)))),
                "hash_ids": ids,
            }
        )
    return rows


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))))


def azure_rows(
    rng: random.Random,
    n: int,
    rate: float,
    input_median: int,
    output_median: int,
    input_max: int,
    output_max: int,
    sigma: tuple[float, float] = (0.8, 0.7),
    burstiness: float = 1.0,
    input_min: int = 8,
) -> list[tuple[float, int, int]]:
    """Azure-layout rows (s from the start, prompt tokens, output tokens): gamma arrivals of
    mean rate `rate` and shape `burstiness` (1: Poisson), prompt and output lengths log-normal
    around their medians (`sigma`), clipped to [input_min, input_max] and [1, output_max]."""
    rows = []
    for t in arrival_offsets(n, rate, burstiness, rng):
        n_in = _lognormal(rng, input_median, sigma[0], input_min, input_max)
        rows.append((t, n_in, _lognormal(rng, output_median, sigma[1], 1, output_max)))
    return rows


def mooncake_rows(
    rng: random.Random,
    n: int,
    rate: float,
    num_documents: int,
    document_blocks: tuple[int, int],
    own_tokens: tuple[int, int],
    output_median: int,
    output_max: int,
    sigma: float = 0.6,
    skew: float = 1.0,
    burstiness: float = 1.0,
) -> list[dict]:
    """Mooncake-layout rows: each prompt a leading part (1 block or more) of one of
    `num_documents` shared documents (each `document_blocks` blocks of MOONCAKE_BLOCK_TOKENS,
    drawn with Zipf popularity `skew`), then `own_tokens` (uniform in the range) of its own, on
    hash ids no other row has; outputs log-normal around `output_median`; gamma arrivals."""
    documents = [
        list(range(d * 1000, d * 1000 + rng.randint(*document_blocks)))
        for d in range(num_documents)
    ]
    weights = zipf_weights(num_documents, skew)
    next_id = 1_000_000
    rows = []
    for t in arrival_offsets(n, rate, burstiness, rng):
        doc = rng.choices(documents, weights)[0]
        shared = doc[: rng.randint(1, len(doc))]
        own = rng.randint(*own_tokens)
        own_blocks = -(-own // MOONCAKE_BLOCK_TOKENS)
        ids = shared + list(range(next_id, next_id + own_blocks))
        next_id += own_blocks
        rows.append(
            {
                "timestamp": round(t * 1000, 3),
                "input_length": len(shared) * MOONCAKE_BLOCK_TOKENS + own,
                "output_length": _lognormal(rng, output_median, sigma, 1, output_max),
                "hash_ids": ids,
            }
        )
    return rows


TRACES = Path(__file__).resolve().parent / "traces"


def write_samples(directory: Path = TRACES) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    azure = directory / "azure_sample.csv"
    mooncake = directory / "mooncake_sample.jsonl"
    write_azure_trace(azure, sample_rows(random.Random(1)))
    write_mooncake_trace(mooncake, mooncake_sample_rows(random.Random(2)))
    return [azure, mooncake]


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write-samples"]:
        for p in write_samples():
            print(p)
    else:
        print("usage: python -m sim.workloads --write-samples")
