"""Token sampling for one step: the logits processors, then greedy, or temperature / min-p /
top-k / top-p then a draw; a seeded request's draw is a hash of (seed, position), so its output
does not depend on the batch or on where it ran before.

Order of processing (vLLM V1's):

1. The logits are widened to float32. A row that asks for logprobs gets them from this raw
   distribution, before anything below.
2. Grammar bitmask (structured outputs), on its rows: every token it does not allow -> -inf.
3. logit_bias: the bias is added to the logit of each given token id.
4. min_tokens: while a row has fewer than `min_tokens` output tokens, its EOS ids (even with
   `ignore_eos`) and its `stop_token_ids` -> -inf.
5. repetition_penalty (the CTRL formula): every token of the prompt or of the output so far:
   logit / p if logit > 0, else logit * p.
6. frequency and presence penalties (OpenAI's formula), over the output tokens only:
   logit -= frequency_penalty * count + presence_penalty * (count > 0).
7. Greedy rows (temperature 0) take the argmax of the processed logits. Others: divide by the
   temperature, drop (-inf) every token whose probability at that temperature is below
   min_p * the row's top probability, then top-k, then top-p, then draw (inverse transform: one
   uniform number per row against the cumulative probabilities). A seeded row's number is
   `seeded_uniform(seed, position)`: a function of the seed and the position of the token
   drawn alone, so its tokens depend neither on the batch, nor on preemptions, nor on the
   replica that draws them (a request resumed elsewhere continues its stream exactly).

Steps 2-6 are `process_logits`, step 7's masking is `sampling_logits`. Each processor is one
batched tensor pass over the rows that use it (gathered, processed, written back) and costs
nothing for a batch in which no row uses it; a row that uses none is left bit-identical.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from replica.request import SamplingParams


class TokenHistory(Protocol):
    """What the processors read of a row's request (replica.request.Request has it)."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...


# (row indices, int32 [len(rows), words]) in xgrammar's packed layout: bit j of word w set
# means token 32 * w + j is allowed
TokenBitmask = tuple[Sequence[int], torch.Tensor]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (logprob of the sampled token, {token: logprob} of the top-k), or None when the
    # request did not ask for logprobs
    logprobs: list[tuple[float, dict[int, float]] | None]


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        draws: Sequence[float | None],
        default_generator: torch.Generator | None = None,
        *,
        histories: Sequence[TokenHistory] | None = None,
        token_bitmask: TokenBitmask | None = None,
        logits_writable: bool = False,
    ) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V]. `draws[i]` is row i's own uniform
        number in [0, 1) (a seeded request's `seeded_uniform`) or None (drawn from
        `default_generator`, all such rows in one op). `logits` are processed in place only
        when `logits_writable` (a caller done with them saves a [B, V] copy per step).
        `histories[i]` is row i's request, needed only when a row uses penalties or
        min_tokens; `token_bitmask` masks the rows it names (see the module docstring)."""
        greedy = [p.temperature == 0.0 for p in params]
        all_greedy = all(greedy)
        any_logprobs = any(p.logprobs is not None for p in params)
        plan = _plan(params, histories, token_bitmask)
        if plan is None and all_greedy and not any_logprobs:
            # no logprobs to compute (bf16 is widened first: its CPU argmax is ~4x slower)
            return SamplerOutput(greedy_tokens(logits.float()).tolist(), [None] * len(params))
        raw = logits.float()
        processed = raw
        if plan is not None:
            # processed in place: on a copy when the raw logits are still needed (logprobs) or
            # are the caller's own tensor that it did not hand over
            work = raw.clone() if any_logprobs or (raw is logits and not logits_writable) else raw
            processed = _apply(work, params, histories, token_bitmask, plan)
        if all_greedy:
            sampled = greedy_tokens(processed)
        else:
            sampled = self._sample(processed, params, greedy, draws, default_generator)
        token_ids = sampled.tolist()
        return SamplerOutput(token_ids, self._logprobs(raw, params, sampled))

    def _sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        greedy: list[bool],
        draws: Sequence[float | None],
        default_generator: torch.Generator | None,
    ) -> torch.Tensor:
        device = logits.device
        probs = torch.softmax(sampling_logits(logits, params), dim=-1)
        # Inverse transform: one uniform u per row picks the first token whose cumulative
        # probability exceeds u times the row's total (float64 sums keep the tail's tiny
        # probabilities). One random number per row, where the exponential race drew V: a
        # seeded row's number is computed from (seed, position) in the caller, and a row costs
        # a cumulative sum rather than V draws (~2 ms at V=49152 on a CPU, per row and step).
        unseeded = [i for i, d in enumerate(draws) if d is None]
        if not unseeded:
            u = torch.tensor(draws, dtype=torch.float64, device=device)
        else:
            u = torch.rand(
                len(draws), dtype=torch.float64, device=device, generator=default_generator
            )
            if len(unseeded) < len(draws):
                seeded = [i for i, d in enumerate(draws) if d is not None]
                values = torch.tensor([draws[i] for i in seeded], dtype=torch.float64)
                u[torch.tensor(seeded, device=device)] = values.to(device)
        sampled = draw_inverse_cdf(probs, u)
        if any(greedy):
            greedy_rows = torch.tensor(greedy, device=device)
            sampled = torch.where(greedy_rows, greedy_tokens(logits), sampled)
        return sampled

    def _logprobs(
        self, logits: torch.Tensor, params: list[SamplingParams], sampled: torch.Tensor
    ) -> list[tuple[float, dict[int, float]] | None]:
        wanted = [p.logprobs for p in params]
        if all(k is None for k in wanted):
            return [None] * len(params)
        # from the model's raw distribution (before any processor, temperature, top-k, top-p),
        # as vLLM does
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, sampled[:, None])[:, 0].tolist()
        k_max = max(k or 0 for k in wanted)
        top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
        top_values = top_values.tolist() if k_max else None
        top_ids = top_ids.tolist() if k_max else None
        out: list[tuple[float, dict[int, float]] | None] = []
        for i, k in enumerate(wanted):
            if k is None:
                out.append(None)
            elif k == 0:
                out.append((chosen[i], {}))
            else:
                out.append((chosen[i], dict(zip(top_ids[i][:k], top_values[i][:k]))))
        return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first index among tied maxima. `max(dim)` finds it ~1.5-2x
    faster than `argmax` on a CPU over a 49k vocabulary (same indices)."""
    return logits.max(dim=-1).indices


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer over x + the golden-ratio increment: 64 well-mixed bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) a request seeded with `seed` draws the token at `position`
    (its index in prompt + output) with: a counter-based draw, the same whatever was drawn
    before, so a seeded stream is reproduced after a preemption, in any batch, and on another
    replica that resumes it. Seeds s and s + 1 (the ingress's n > 1 choices) give unrelated
    streams: the seed is mixed on its own before the position joins it."""
    key = _mix64((_mix64(seed & _MASK64) + position) & _MASK64)
    return (key >> 11) * (1.0 / (1 << 53))


def draw_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [B, V] (each summing to ~1), the first token whose cumulative
    probability exceeds u * the row's total, for u [B] in [0, 1) (float64): a draw from the row's
    distribution that never picks a token of probability 0."""
    cdf = probs.double().cumsum_(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    sampled = torch.searchsorted(cdf, target, right=True)[:, 0]
    vocab = probs.shape[1]
    beyond = sampled >= vocab  # u * total rounded up to the total: the last possible token
    if bool(beyond.any()):
        last = vocab - 1 - (probs > 0).flip(-1).to(torch.float32).argmax(dim=-1)
        sampled = torch.where(beyond, last, sampled)
    return sampled


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    *,
    histories: Sequence[TokenHistory] | None = None,
    token_bitmask: TokenBitmask | None = None,
) -> torch.Tensor:
    """`logits` [B, V] after steps 1-6 (float32: bitmask, logit_bias, min_tokens, repetition,
    frequency and presence penalties). `logits` itself is never modified; when no processor
    applies, the result is `logits.float()` (which is `logits` itself if already float32)."""
    plan = _plan(params, histories, token_bitmask)
    work = logits.float()
    if plan is None:
        return work
    if work is logits:
        work = work.clone()
    return _apply(work, params, histories, token_bitmask, plan)


def sampling_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The logits a sampled row draws from (softmax of the result): the processed `logits`
    divided by the temperature, then min_p, top-k and top-p set dropped tokens to -inf. A
    greedy row is kept at temperature 1 and without min_p (it takes the processed argmax)."""
    device = logits.device
    temperatures = [1.0 if p.temperature == 0.0 else p.temperature for p in params]
    scaled = logits / torch.tensor(temperatures, device=device)[:, None]
    min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0.0 and p.temperature != 0.0]
    if min_p_rows:
        min_ps = torch.tensor([params[i].min_p for i in min_p_rows], device=device)

        def drop_unlikely(rows: torch.Tensor) -> torch.Tensor:
            probs = torch.softmax(rows, dim=-1)
            threshold = min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
            return rows.masked_fill(probs < threshold, float("-inf"))

        _on_rows(scaled, min_p_rows, drop_unlikely)
    top_ks = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_ps = [p.top_p for p in params]
    if any(top_ks) or any(p < 1.0 for p in top_ps):
        scaled = _top_k_top_p(scaled, top_ks, top_ps)
    return scaled


@dataclass
class _Plan:
    """The rows each processor applies to (bitmask rows come with the bitmask)."""

    bias_rows: list[int]
    min_tokens_rows: list[int]  # rows still short of min_tokens
    penalty_rows: list[int]
    has_bitmask: bool


def _plan(
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory] | None,
    token_bitmask: TokenBitmask | None,
) -> _Plan | None:
    """Which rows use which processor; None when no row uses any."""
    if histories is not None and len(histories) != len(params):
        raise ValueError(f"{len(histories)} histories for a batch of {len(params)} rows")
    bias_rows: list[int] = []
    min_tokens_rows: list[int] = []
    penalty_rows: list[int] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            bias_rows.append(i)
        if p.min_tokens > 0 or p.uses_penalties:
            if histories is None:
                raise ValueError(
                    f"row {i} uses penalties or min_tokens: the sampler needs its histories"
                )
            if p.min_tokens > 0 and histories[i].num_output_tokens < p.min_tokens:
                min_tokens_rows.append(i)
            if p.uses_penalties:
                penalty_rows.append(i)
    has_bitmask = token_bitmask is not None and len(token_bitmask[0]) > 0
    if not (bias_rows or min_tokens_rows or penalty_rows or has_bitmask):
        return None
    return _Plan(bias_rows, min_tokens_rows, penalty_rows, has_bitmask)


def _apply(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory] | None,
    token_bitmask: TokenBitmask | None,
    plan: _Plan,
) -> torch.Tensor:
    """Steps 2-6 on `logits` (float32 [B, V], modified in place and returned)."""
    if plan.has_bitmask:
        rows, bitmask = token_bitmask
        _apply_bitmask(logits, rows, bitmask)
    if plan.bias_rows:
        _apply_logit_bias(logits, params, plan.bias_rows)
    if plan.min_tokens_rows:
        _apply_min_tokens(logits, params, histories, plan.min_tokens_rows)
    if plan.penalty_rows:
        _apply_penalties(logits, params, histories, plan.penalty_rows)
    return logits


def _load_xgrammar_apply():
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:  # the torch unpack below serves
        return None
    return apply_token_bitmask_inplace


# loaded at the first grammar mask (importing xgrammar imports transformers: ~2 s of an engine
# core's start that no unconstrained request needs; a structured request's grammar compiles
# beside the loop first, which has imported it by then); None: the torch unpack below
_UNLOADED = object()
_xgrammar_apply = _UNLOADED


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size] from xgrammar's packed int32 [R, words]: token t is allowed iff
    bit t % 32 of word t // 32 is set. Tokens past 32 * words are disallowed; bits past
    vocab_size are ignored."""
    words = min(bitmask.shape[1], -(-vocab_size // 32))
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    # an arithmetic shift of a negative word (bit 31 set) still leaves the right bit at 0
    bits = (bitmask[:, :words, None].to(torch.int32) >> shifts) & 1
    bits = bits.reshape(bitmask.shape[0], words * 32)
    if words * 32 >= vocab_size:
        return bits[:, :vocab_size].bool()
    return torch.nn.functional.pad(bits, (0, vocab_size - words * 32)).bool()


def _apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    batch, vocab = logits.shape
    # row j of the mask masks logits row rows[j]; or (a runner's reused buffer) the mask has a
    # row per logits row and only `rows` are read
    by_logits_row = bitmask.dim() == 2 and bitmask.shape[0] == batch and len(rows) < batch
    if bitmask.dim() != 2 or not (bitmask.shape[0] == len(rows) or by_logits_row):
        raise ValueError(
            f"token bitmask of shape {tuple(bitmask.shape)} for {len(rows)} rows: expected "
            f"[{len(rows)}, words] or [{batch}, words]"
        )
    if any(not 0 <= r < batch for r in rows):
        raise ValueError(f"token bitmask rows {list(rows)} out of range for {batch} rows")
    bitmask = bitmask.to(logits.device, torch.int32, non_blocking=True)
    global _xgrammar_apply
    if _xgrammar_apply is _UNLOADED:
        _xgrammar_apply = _load_xgrammar_apply()
    index = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
    words = bitmask.shape[1]
    if _xgrammar_apply is not None and logits.dtype == torch.float32:
        # xgrammar's kernel (C++ on CPU, CUDA/Triton on GPUs): 3-4x faster than the unpack
        # below, a visible share of a small model's step. It reads the mask by logits row.
        if not by_logits_row and list(rows) != list(range(batch)):
            full = torch.full((batch, words), -1, dtype=torch.int32, device=logits.device)
            full[index] = bitmask
            bitmask = full
        _xgrammar_apply(logits, bitmask, vocab_size=min(vocab, words * 32), indices=list(rows))
        if vocab > words * 32:  # past the mask's width nothing is allowed
            logits[index, words * 32 :] = float("-inf")
        return
    allowed = unpack_bitmask(bitmask[index] if by_logits_row else bitmask, vocab)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _apply_logit_bias(
    logits: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]
) -> None:
    vocab = logits.shape[1]
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i in rows:
        for token, bias in params[i].logit_bias.items():
            if not 0 <= token < vocab:
                raise ValueError(
                    f"logit_bias token id {token} is out of range for a vocabulary of "
                    f"{vocab} tokens"
                )
            row_ids.append(i)
            token_ids.append(token)
            biases.append(bias)
    device = logits.device
    index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
    values = torch.tensor(biases, dtype=logits.dtype, device=device)
    logits.index_put_(index, values, accumulate=True)


def _apply_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    rows: list[int],
) -> None:
    vocab = logits.shape[1]
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i in rows:
        # an id past the logits (a tokenizer's id the model cannot emit) needs no mask
        banned = {t for t in histories[i].eos_token_ids if 0 <= t < vocab}
        banned.update(t for t in params[i].stop_token_ids if 0 <= t < vocab)
        row_ids.extend([i] * len(banned))
        token_ids.extend(banned)
    if not token_ids:
        return
    device = logits.device
    index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
    logits.index_put_(index, torch.tensor(float("-inf"), device=device))


def _apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    rows: list[int],
) -> None:
    """Repetition, then frequency and presence penalties, on the gathered `rows` at once:
    the output-token counts [R, V] come from one scatter_add over all rows' tokens."""
    device = logits.device
    num_rows, vocab = len(rows), logits.shape[1]
    outputs = [histories[i].output_token_ids for i in rows]
    repetition = [params[i].repetition_penalty for i in rows]
    # the prompt is read only for the rows with a repetition penalty
    prompts = [histories[i].prompt_token_ids if p != 1.0 else () for i, p in zip(rows, repetition)]
    if not any(outputs) and not any(prompts):
        return  # nothing generated yet and no repetition penalty: every penalty is 0

    def flat_ids(token_lists: list[Sequence[int]]) -> torch.Tensor:
        """row * V + token for every token of every row, one tensor."""
        tokens = list(itertools.chain.from_iterable(token_lists))
        tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        lengths = torch.tensor([len(t) for t in token_lists], device=device)
        row_of = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)
        return row_of * vocab + tokens

    index = torch.tensor(rows, device=device)
    sub = logits[index]
    counts = torch.zeros(num_rows * vocab, dtype=sub.dtype, device=device)
    if any(outputs):
        output_ids = flat_ids(outputs)
        counts.scatter_add_(0, output_ids, torch.ones_like(output_ids, dtype=sub.dtype))
    counts = counts.view(num_rows, vocab)
    generated = counts > 0

    if any(p != 1.0 for p in repetition):
        seen = generated.clone()
        if any(prompts):
            seen.view(-1)[flat_ids(prompts)] = True
        penalty = torch.tensor(repetition, dtype=sub.dtype, device=device)[:, None]
        # rows with p == 1 are unchanged exactly (x / 1 == x * 1 == x)
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)

    frequency = [params[i].frequency_penalty for i in rows]
    presence = [params[i].presence_penalty for i in rows]
    if any(outputs) and (any(frequency) or any(presence)):
        freq = torch.tensor(frequency, dtype=sub.dtype, device=device)[:, None]
        pres = torch.tensor(presence, dtype=sub.dtype, device=device)[:, None]
        sub = sub - (freq * counts + pres * generated)
    logits[index] = sub


def _on_rows(logits: torch.Tensor, rows: list[int], fn) -> None:
    """logits[rows] = fn(logits[rows]) in place, without a gather when every row is in."""
    if len(rows) == logits.shape[0]:
        logits.copy_(fn(logits))
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = fn(logits[index])


# a top-p row without top-k looks for its nucleus among its NUCLEUS_CANDIDATES most likely
# tokens first; past them, a histogram of its log-probabilities (buckets of LOGPROB_SPAN /
# NUCLEUS_BUCKETS nats; everything below -SPAN in the last) says how many tokens it may span,
# and it is cut over that many candidates, or sorted whole when they are a quarter of the
# vocabulary or more (a full sort of a 49k vocabulary is ~6 ms a row on a CPU core, topk of 256
# ~0.25 ms)
NUCLEUS_CANDIDATES = 256
NUCLEUS_BUCKETS = 128
LOGPROB_SPAN = 40.0


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k, then outside its top-p nucleus (the
    smallest set of most likely tokens whose mass reaches p; the top token always stays).

    Only the rows that cut are touched, and they are cut over their `topk` candidates rather
    than a sort of the whole vocabulary: a top-k row's k tokens, a top-p row's
    NUCLEUS_CANDIDATES, or when its nucleus reaches past them the tokens down to the histogram
    bucket where its mass reaches p (`_nucleus_widths`); a row whose candidates would be a
    quarter of the vocabulary or more, or whose nucleus still reaches past them (rounding at a
    bucket's edge), is sorted whole. Tokens tied exactly at the cut may be kept in another
    order than a full sort's."""
    device = logits.device
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    rows = [i for i, (k, p) in enumerate(zip(ks, top_ps)) if k < vocab or p < 1.0]
    if not rows:
        return logits
    whole_batch = len(rows) == logits.shape[0]
    sub = logits if whole_batch else logits[torch.tensor(rows, device=device)]
    sub_ks = [ks[i] for i in rows]
    sub_ps = [top_ps[i] for i in rows]
    partial = [j for j, k in enumerate(sub_ks) if k >= vocab]  # top-p without top-k
    log_total = None
    widths = [k if k < vocab else NUCLEUS_CANDIDATES for k in sub_ks]
    sized: set[int] = set()  # top-p rows whose width their histogram gave
    if partial:  # a top-p row's candidates are weighed against its whole row
        index = torch.tensor(partial, device=device)
        rows_of = sub[index]
        log_total = torch.zeros(len(rows), 1, dtype=sub.dtype, device=device)
        log_total[index] = torch.logsumexp(rows_of, dim=-1, keepdim=True)
        # a row whose top token's probability times NUCLEUS_CANDIDATES is below p cannot
        # hold its nucleus in that many: sized by its histogram at once
        top = (rows_of.amax(dim=-1) - log_total[index][:, 0]).exp() * NUCLEUS_CANDIDATES
        short = [j for j, t in zip(partial, top.tolist()) if t < sub_ps[j]]
        _size_by_histogram(sub, log_total, sub_ps, short, widths, sized)
    cut = torch.empty_like(sub)
    pending = list(range(len(rows)))
    while pending:
        index = torch.tensor(pending, device=device)
        part = sub if len(pending) == len(rows) else sub[index]
        part_ks = [sub_ks[j] for j in pending]
        part_ps = [sub_ps[j] for j in pending]
        width = max(widths[j] for j in pending)
        if 4 * width >= vocab:  # candidates near the vocabulary's size: sort the rows whole
            done = _cut_sorted(part, *part.sort(dim=-1, descending=True), part_ks, part_ps)
            more = []
        else:
            part_total = None if log_total is None else log_total[index]
            done, more = _cut_candidates(part, width, part_ks, part_ps, part_total)
        if len(pending) == len(rows) and not more:
            cut = done
        else:
            cut[index] = done
        pending = [pending[j] for j in more]  # their nucleus reaches past the candidates
        for j in pending:  # sized already: the histogram's edge rounding; sorted whole
            if j in sized:
                widths[j] = vocab
        _size_by_histogram(sub, log_total, sub_ps, [j for j in pending if j not in sized],
                           widths, sized)  # fmt: skip
    if whole_batch:
        return cut
    out = logits.clone()
    out[torch.tensor(rows, device=device)] = cut
    return out


def _size_by_histogram(sub, log_total, top_ps, rows: list[int], widths, sized) -> None:
    """widths[j] = `_nucleus_widths` of each top-p row j in `rows`, which joins `sized`."""
    if not rows:
        return
    index = torch.tensor(rows, device=sub.device)
    found = _nucleus_widths(sub[index] - log_total[index], [top_ps[j] for j in rows])
    for j, width in zip(rows, found):
        widths[j] = width
        sized.add(j)


def _nucleus_widths(logprobs: torch.Tensor, top_ps: list[float]) -> list[int]:
    """Per row of `logprobs` [R, V], how many of its most likely tokens hold its top-p
    nucleus: the tokens down to the end of the histogram bucket where the mass reaches p, plus
    one (the candidate after the nucleus shows that it ended)."""
    rows, vocab = logprobs.shape
    device = logprobs.device
    scale = NUCLEUS_BUCKETS / LOGPROB_SPAN
    bucket = (logprobs * -scale).clamp_(0, NUCLEUS_BUCKETS - 1).long()
    bucket += torch.arange(rows, device=device)[:, None] * NUCLEUS_BUCKETS
    size = rows * NUCLEUS_BUCKETS
    mass = torch.bincount(bucket.view(-1), weights=logprobs.exp().view(-1), minlength=size)
    count = torch.bincount(bucket.view(-1), minlength=size)
    mass = mass.view(rows, NUCLEUS_BUCKETS).cumsum(-1)
    count = count.view(rows, NUCLEUS_BUCKETS).cumsum(-1)
    ps = torch.tensor(top_ps, dtype=mass.dtype, device=device)[:, None]
    # the first bucket whose cumulative mass passes p (by a margin for the rounding of sums
    # taken in another order), then the one after it
    last = ((mass < ps + 1e-4).sum(-1) + 1).clamp_(max=NUCLEUS_BUCKETS - 1)
    return (count.gather(1, last[:, None])[:, 0] + 1).clamp_(max=vocab).tolist()


def _cut_sorted(
    logits: torch.Tensor,
    sorted_logits: torch.Tensor,
    order: torch.Tensor,
    top_ks: list[int],
    top_ps: list[float],
    log_total: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rows of `logits` with every token outside top-k / top-p at -inf, from the rows'
    most likely tokens `sorted_logits` (descending) at `order` (all of the row's, or its
    leading candidates: then a top-p row's probabilities are against `log_total`, the
    logsumexp of its whole row, and a top-k row's against its k tokens)."""
    device = logits.device
    width = sorted_logits.shape[-1]
    ranks = torch.arange(width, device=device)[None, :]
    ks = torch.tensor([min(k, width) for k in top_ks], device=device)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    ps = torch.tensor(top_ps, device=device, dtype=logits.dtype)
    if log_total is None:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
    else:
        vocab = logits.shape[-1]
        partial = torch.tensor([k >= vocab for k in top_ks], device=device)[:, None]
        sorted_probs = torch.where(
            partial, (sorted_logits - log_total).exp(), torch.softmax(sorted_logits, dim=-1)
        )
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # p == 1 keeps everything exactly (cumulative sums can round past 1.0)
    outside = (mass_before >= ps[:, None]) & (ps[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _cut_candidates(
    logits: torch.Tensor,
    width: int,
    top_ks: list[int],
    top_ps: list[float],
    log_total: torch.Tensor | None,
) -> tuple[torch.Tensor, list[int]]:
    """`_cut_sorted` over each row's `width` most likely tokens; also the rows (top-p without
    top-k) whose nucleus may reach past them (their last candidate is still inside it): their
    cut is not final."""
    vocab = logits.shape[-1]
    values, ids = logits.topk(width, dim=-1)  # sorted, most likely first
    cut = _cut_sorted(logits, values, ids, top_ks, top_ps, log_total)
    more = []
    partial = [j for j, k in enumerate(top_ks) if k >= vocab]
    if partial:
        last_kept = cut.gather(1, ids[:, -1:])[:, 0] > float("-inf")
        more = [j for j in partial if bool(last_kept[j])]
    return cut, more
