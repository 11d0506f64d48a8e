"""Sampler semantics (greedy, temperature, top-k, top-p, logprobs), the logits processors (grammar
bitmask, logit_bias, min_tokens, penalties, min_p) against plain-loop references in mixed
batches, and seeded sampling that reproduces across runs, batch compositions and preemption."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from replica.layers import sampler as sampler_module
from replica.layers.sampler import (
    Sampler,
    draw_inverse_cdf,
    process_logits,
    sampling_logits,
    seeded_uniform,
    unpack_bitmask,
)
from replica.request import Request, SamplingParams
from tests.helpers import scheduler_request

sampler = Sampler()


def _draw(logits: torch.Tensor, params: SamplingParams, rows: int = 4000, seed: int = 0):
    """`rows` independent draws from one distribution, in one batched call."""
    generator = torch.Generator().manual_seed(seed)
    batch = logits.expand(rows, -1).clone()
    return sampler(batch, [params] * rows, [None] * rows, generator).token_ids


LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_greedy_rows_take_the_argmax_even_beside_sampled_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 3
    out = sampler(logits, params, [None] * 6, torch.Generator().manual_seed(0))
    expected = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]
    assert out.logprobs == [None] * 6


def test_temperature_one_draws_from_the_softmax():
    counts = torch.bincount(
        torch.tensor(_draw(LOGITS, SamplingParams(temperature=1.0))), minlength=4
    )
    freqs = counts.float() / counts.sum()
    torch.testing.assert_close(freqs, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)


def test_inverse_cdf_draw_at_its_edges_never_picks_an_impossible_token():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9999999, 1.0], dtype=torch.float64)
    # u = 1 cannot be drawn (torch.rand is in [0, 1)): it stands for u * total rounding up
    assert draw_inverse_cdf(probs, u).tolist() == [1, 1, 3, 3, 3]


def test_a_large_vocabulary_with_a_long_tail_keeps_its_frequencies():
    """V = 49152 (the default model's) with most of it at probability 0 and a head of four:
    the draws follow the head and never leave the allowed tokens."""
    logits = torch.full((49152,), float("-inf"))
    allowed = torch.tensor([7, 20000, 31337, 49151])
    logits[allowed] = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    tokens = torch.tensor(_draw(logits, SamplingParams(temperature=1.0), rows=2000))
    assert set(tokens.tolist()) <= set(allowed.tolist())
    freqs = torch.stack([(tokens == t).float().mean() for t in allowed])
    torch.testing.assert_close(freqs, torch.tensor([0.4, 0.3, 0.2, 0.1]), atol=0.04, rtol=0)


def test_low_temperature_sharpens_the_distribution():
    tokens = _draw(LOGITS, SamplingParams(temperature=0.25))
    expected = torch.softmax(LOGITS / 0.25, dim=-1)
    freqs = torch.bincount(torch.tensor(tokens), minlength=4).float() / len(tokens)
    torch.testing.assert_close(freqs, expected, atol=0.03, rtol=0)


def test_top_k_keeps_only_the_k_most_likely():
    tokens = set(_draw(LOGITS, SamplingParams(temperature=1.0, top_k=2)))
    assert tokens == {0, 1}
    assert set(_draw(LOGITS, SamplingParams(temperature=2.0, top_k=1), rows=200)) == {0}


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    # 0.5 alone < 0.7 <= 0.5 + 0.3: the nucleus is tokens {0, 1}
    assert set(_draw(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))) == {0, 1}
    # the most likely token always stays, however small p is
    assert set(_draw(LOGITS, SamplingParams(temperature=1.0, top_p=0.01), rows=200)) == {0}


def test_top_k_and_top_p_rows_do_not_leak_into_other_rows():
    rows = 3000
    batch = LOGITS.expand(rows, -1).clone()
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0)] * (
        rows // 2
    )
    out = sampler(batch, params, [None] * rows, torch.Generator().manual_seed(3)).token_ids
    assert set(out[0::2]) == {0}
    assert set(out[1::2]) == {0, 1, 2, 3}


def test_seeded_row_does_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(4))
    params = (
        [SamplingParams(temperature=0.9, top_p=0.95, seed=7)]
        + [SamplingParams(temperature=1.0, seed=s) for s in (1, 2)]
        + [SamplingParams(temperature=1.0)] * 2
    )

    def draws(batch_rows: list[int], steps: int = 20) -> list[int]:
        default = torch.Generator().manual_seed(99)
        out = []
        for position in range(steps):
            row_draws = [
                None if params[i].seed is None else seeded_uniform(params[i].seed, position)
                for i in batch_rows
            ]
            result = sampler(
                logits[batch_rows], [params[i] for i in batch_rows], row_draws, default
            )
            out.append(result.token_ids[batch_rows.index(0)])
        return out

    alone = draws([0])
    assert draws([3, 0, 1]) == alone
    assert draws([2, 4, 1, 3, 0]) == alone
    assert len(set(alone)) > 1  # really sampled, not greedy


def test_seeded_uniform_depends_on_seed_and_position_only():
    first = [seeded_uniform(7, p) for p in range(2000)]
    assert first == [seeded_uniform(7, p) for p in range(2000)]
    assert all(0.0 <= u < 1.0 for u in first)
    assert len(set(first)) == len(first)
    # roughly uniform: each tenth of [0, 1) holds about a tenth of the draws
    tenths = [sum(1 for u in first if k / 10 <= u < (k + 1) / 10) for k in range(10)]
    assert min(tenths) > 140 and max(tenths) < 260, tenths
    # the ingress's n > 1 choices use seeds s, s + 1, ...: no shifted copy of one another
    shifted = [seeded_uniform(8, p) for p in range(2000)]
    assert not set(first[1:]) & set(shifted)
    # the extremes of the seed range are valid seeds
    assert seeded_uniform(-1, 0) != seeded_uniform(2**63 - 1, 0)


def test_logprobs_come_from_the_raw_distribution():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.7, top_k=5, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    out = sampler(logits, params, [None] * 3, torch.Generator().manual_seed(0))
    raw = torch.log_softmax(logits, dim=-1)
    sampled_lp, top = out.logprobs[0]
    assert sampled_lp == pytest.approx(raw[0, out.token_ids[0]].item())
    top_values, top_ids = raw[0].topk(3)
    assert list(top) == top_ids.tolist()
    assert list(top.values()) == pytest.approx(top_values.tolist())
    # temperature and top-k do not change the reported logprob
    sampled_lp, top = out.logprobs[1]
    assert sampled_lp == pytest.approx(raw[1, out.token_ids[1]].item())
    assert top == {}
    assert out.logprobs[2] is None


# -- logits processors --------------------------------------------------------------------
# Each processor is checked against a plain per-row loop over its formula, in a batch that mixes
# rows with and without it (and different values per row).
V = 48
EOS = 2
INF = float("-inf")


def _request(prompt: list[int], output: list[int], params: SamplingParams, eos=(EOS,)):
    request = scheduler_request("r", prompt, params, eos=set(eos))
    request.all_token_ids.extend(output)
    return request


def _without_processors(p: SamplingParams) -> SamplingParams:
    """The same sampling (temperature, top-k/p, min_p, seed) with no logits processor."""
    return dataclasses.replace(
        p,
        min_tokens=0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logit_bias=None,
    )


def _random_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


Reference = Callable[[list[float], SamplingParams, Request, int], list[float]]


def _check_against_reference(
    logits: torch.Tensor,
    params: list[SamplingParams],
    requests: list[Request],
    reference: Reference,
    uses: list[bool],
    token_bitmask=None,
) -> torch.Tensor:
    """process_logits matches `reference` row by row; rows that do not use the processor are
    bit-identical to a batch where no row uses it; greedy rows take the reference argmax; and
    every row (sampled ones with their own seeded generator) draws exactly what the sampler
    draws from the processed logits with no processor, i.e. from softmax(processed / T)."""
    batch = len(params)
    assert any(uses) and not all(uses)
    assert any(p.greedy for p in params) and not all(p.greedy for p in params)
    processed = process_logits(logits, params, histories=requests, token_bitmask=token_bitmask)
    expected = torch.tensor(
        [reference(logits[i].tolist(), params[i], requests[i], i) for i in range(batch)]
    )
    torch.testing.assert_close(processed, expected)

    plain_params = [_without_processors(p) for p in params]
    plain = process_logits(logits, plain_params, histories=requests)
    assert torch.equal(plain, logits)
    for i in range(batch):
        if not uses[i]:
            assert torch.equal(processed[i], plain[i])

    def draws(x: torch.Tensor, ps: list[SamplingParams], **kwargs) -> list[list[int]]:
        return [
            sampler(x, ps, [seeded_uniform(100 + i, s) for i in range(batch)], **kwargs).token_ids
            for s in range(10)
        ]

    got = draws(logits, params, histories=requests, token_bitmask=token_bitmask)
    assert got == draws(processed, plain_params)
    for i, p in enumerate(params):
        if p.greedy:
            assert got[0][i] == expected[i].argmax().item()
    return processed


def _reference_penalties(row: list[float], p: SamplingParams, request: Request, i: int):
    row = list(row)
    output = list(request.output_token_ids)
    if p.repetition_penalty != 1.0:
        for t in set(request.prompt_token_ids) | set(output):
            if row[t] > 0:
                row[t] = row[t] / p.repetition_penalty
            else:
                row[t] = row[t] * p.repetition_penalty
    for t in set(output):
        count = output.count(t)
        row[t] -= p.frequency_penalty * count + p.presence_penalty * (1 if count > 0 else 0)
    return row


PROMPTS = [[1, 5, 9, 9, 30], [3, 4], [7, 7, 7, 8, 40, 41], [0, 47], [12, 13, 14]]
OUTPUTS = [[5, 6, 6, 6, 11], [4, 4, 20], [], [47, 1, 1, 1, 1, 2], [13, 33, 33]]


def _penalty_batch(**per_row: list) -> tuple[list[SamplingParams], list[Request]]:
    temperatures = [0.0, 0.8, 0.0, 1.2, 1.0]
    params = [
        SamplingParams(temperature=t, **{k: v[i] for k, v in per_row.items()})
        for i, t in enumerate(temperatures)
    ]
    requests = [_request(PROMPTS[i], OUTPUTS[i], p) for i, p in enumerate(params)]
    return params, requests


def test_presence_penalty_matches_the_reference_per_row():
    params, requests = _penalty_batch(presence_penalty=[1.5, -0.7, 0.0, 2.0, 0.0])
    _check_against_reference(
        _random_logits(5),
        params,
        requests,
        _reference_penalties,
        [p.uses_penalties for p in params],
    )


def test_frequency_penalty_matches_the_reference_per_row():
    params, requests = _penalty_batch(frequency_penalty=[0.0, 1.0, 2.0, -1.5, 0.3])
    _check_against_reference(
        _random_logits(5, seed=1),
        params,
        requests,
        _reference_penalties,
        [p.uses_penalties for p in params],
    )


def test_repetition_penalty_matches_the_reference_per_row():
    # prompt tokens count too: row 2 has no output yet and is still penalized
    params, requests = _penalty_batch(repetition_penalty=[1.3, 1.0, 2.0, 0.5, 1.0])
    processed = _check_against_reference(
        _random_logits(5, seed=2),
        params,
        requests,
        _reference_penalties,
        [p.uses_penalties for p in params],
    )
    raw = _random_logits(5, seed=2)
    assert not torch.equal(processed[2], raw[2])


def test_all_penalties_together_match_the_reference():
    params, requests = _penalty_batch(
        repetition_penalty=[1.3, 1.0, 1.7, 0.8, 1.0],
        frequency_penalty=[0.5, 0.0, -0.4, 1.0, 0.0],
        presence_penalty=[0.2, 0.0, 0.9, -1.0, 0.0],
    )
    _check_against_reference(
        _random_logits(5, seed=3),
        params,
        requests,
        _reference_penalties,
        [p.uses_penalties for p in params],
    )


def test_penalty_counts_are_right_for_a_token_repeated_many_times():
    logits = torch.zeros(3, V)
    logits[:, 5] = 10.0
    logits[:, 7] = -2.0
    logits[:, 8] = 0.5
    penalized = SamplingParams(
        temperature=0.0, frequency_penalty=0.25, presence_penalty=0.5, repetition_penalty=2.0
    )
    output = [5] * 60 + [7] * 3 + [9]
    requests = [
        _request([5, 8], output, penalized),
        _request([1], [5] * 10, SamplingParams(temperature=0.0)),
        _request([5, 8], output, penalized),  # same tokens in another row: no cross-talk
    ]
    params = [r.sampling_params for r in requests]
    processed = process_logits(logits, params, histories=requests)
    for row in (0, 2):
        assert processed[row, 5].item() == pytest.approx(10.0 / 2.0 - 0.25 * 60 - 0.5)
        assert processed[row, 7].item() == pytest.approx(-2.0 * 2.0 - 0.25 * 3 - 0.5)
        assert processed[row, 9].item() == pytest.approx(0.0 - 0.25 - 0.5)
        assert processed[row, 8].item() == 0.25  # in the prompt only: repetition alone
        assert processed[row, 1].item() == 0.0
    assert torch.equal(processed[1], logits[1])
    assert sampler(logits, params, [None] * 3, histories=requests).token_ids == [8, 5, 8]


def test_logit_bias_matches_the_reference_per_row():
    biases = [{3: 5.0, 10: -100.0}, None, {0: 100.0}, None, {47: -2.5, 3: 0.5, 11: 1.0}]
    params = [
        SamplingParams(temperature=t, logit_bias=b)
        for t, b in zip([0.0, 0.0, 0.9, 1.0, 0.0], biases)
    ]
    requests = [_request([1], [], p) for p in params]

    def reference(row, p, request, i):
        row = list(row)
        for t, b in (p.logit_bias or {}).items():
            row[t] += b
        return row

    _check_against_reference(
        _random_logits(5, seed=4), params, requests, reference, [b is not None for b in biases]
    )
    # the rows need no histories
    out = sampler(_random_logits(5, seed=4), params, [None] * 5, torch.Generator().manual_seed(0))
    assert out.token_ids[2] == 0


def test_logit_bias_past_the_vocabulary_is_rejected():
    params = [SamplingParams(temperature=0.0, logit_bias={V: 1.0})]
    with pytest.raises(ValueError, match=f"{V}.*{V}"):
        sampler(_random_logits(1), params, [None])


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = _random_logits(6, seed=5)
    logits[:, EOS] = 20.0  # EOS is every row's argmax
    logits[:, 9] = 19.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9]),  # 1 output: masked
        SamplingParams(temperature=0.0, min_tokens=2),  # 2 outputs: reached, unchanged
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_tokens=4, ignore_eos=True),  # masked anyway
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[9, 44]),
    ]
    outputs = [[4], [4, 5], [], [1, 2, 3], [], [1]]
    eos_ids = [(EOS,), (EOS,), (EOS,), (EOS, 30), (EOS,), (EOS, 31, 1000)]  # 1000 >= V: ignored
    requests = [_request([1], o, p, eos=e) for o, p, e in zip(outputs, params, eos_ids)]

    def reference(row, p, request, i):
        row = list(row)
        if request.num_output_tokens < p.min_tokens:
            for t in set(request.eos_token_ids) | set(p.stop_token_ids):
                if t < V:
                    row[t] = INF
        return row

    processed = _check_against_reference(
        logits, params, requests, reference, [True, False, False, True, False, True]
    )
    assert processed[3, 30].item() == INF and processed[5, 44].item() == INF
    tokens = sampler(logits, params, [None] * 6, histories=requests).token_ids
    assert tokens[0] not in (EOS, 9) and tokens[1] == EOS and tokens[5] not in (EOS, 9, 44, 31)


def test_processors_without_histories_are_an_error():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, min_tokens=1)]
    with pytest.raises(ValueError, match="histories"):
        sampler(_random_logits(2), params, [None, None])
    params[1] = SamplingParams(temperature=0.0, presence_penalty=0.5)
    with pytest.raises(ValueError, match="histories"):
        process_logits(_random_logits(2), params)


def _reference_min_p(row: list[float], p: SamplingParams) -> set[int]:
    """Tokens that survive min_p at the row's temperature."""
    scaled = [x / p.temperature for x in row]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    return {t for t, q in enumerate(probs) if q >= p.min_p * max(probs)}


def test_min_p_keeps_the_tokens_the_reference_keeps():
    logits = _random_logits(5, seed=6)
    params = [
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.3, min_p=0.3),
        SamplingParams(temperature=0.0, min_p=0.5),  # greedy: min_p does not apply
        SamplingParams(temperature=1.0, min_p=0.02),
    ]
    masked = sampling_logits(logits, params)
    for i, p in enumerate(params):
        t = p.temperature or 1.0
        finite = set(torch.isfinite(masked[i]).nonzero()[:, 0].tolist())
        if p.min_p > 0 and not p.greedy:
            assert finite == _reference_min_p(logits[i].tolist(), p)
            assert 1 < len(finite) < V
        else:
            assert finite == set(range(V))
        kept = sorted(finite)
        assert torch.equal(masked[i, kept], logits[i, kept] / t)
    # rows without min_p are bit-identical to a batch without any
    plain = sampling_logits(logits, [dataclasses.replace(p, min_p=0.0) for p in params])
    assert torch.equal(masked[[1, 3]], plain[[1, 3]])
    # the draws come only from the survivors
    rows = 600
    batch = logits[2].expand(rows, -1).clone()
    tokens = set(sampler(batch, [params[2]] * rows, [None] * rows).token_ids)
    assert 1 < len(tokens) and tokens <= _reference_min_p(logits[2].tolist(), params[2])


def test_min_p_applies_after_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    survivors = {}
    for t in (0.5, 1.0, 2.0):
        p = SamplingParams(temperature=t, min_p=0.2)
        masked = sampling_logits(logits, [p])
        survivors[t] = set(torch.isfinite(masked[0]).nonzero()[:, 0].tolist())
        assert survivors[t] == _reference_min_p(logits[0].tolist(), p)
    # at T=1: p >= 0.2 * 0.5 keeps {0, 1, 2}; sharper (T=0.5) keeps fewer, flatter keeps more
    assert survivors[1.0] == {0, 1, 2}
    assert survivors[0.5] == {0, 1}
    assert survivors[2.0] == {0, 1, 2, 3, 4}
    # then top-k cuts further
    p = SamplingParams(temperature=2.0, min_p=0.2, top_k=2)
    assert set(torch.isfinite(sampling_logits(logits, [p])[0]).nonzero()[:, 0].tolist()) == {0, 1}


def _pack_bitmask(allowed: list[set[int]], words: int) -> torch.Tensor:
    """xgrammar's layout, by hand: bit j of word w set = token 32 * w + j allowed."""
    packed = []
    for tokens in allowed:
        row = []
        for w in range(words):
            word = sum(1 << j for j in range(32) if 32 * w + j in tokens)
            row.append(word - (1 << 32) if word >= 1 << 31 else word)  # as int32
        packed.append(row)
    return torch.tensor(packed, dtype=torch.int32)


@pytest.mark.parametrize("vocab, words", [(70, 3), (70, 2), (40, 3), (64, 2), (5, 1)])
def test_bitmask_unpacks_for_any_vocab_size(vocab, words):
    # bit 31 (the int32 sign bit) included; bits past the vocabulary must be ignored
    allowed = [
        {0, 31, 32, 63, 64, 69, 70, 95},
        set(range(0, 96, 3)),
        set(),
        set(range(96)),
    ]
    unpacked = unpack_bitmask(_pack_bitmask(allowed, words), vocab)
    assert unpacked.shape == (4, vocab) and unpacked.dtype == torch.bool
    for i, tokens in enumerate(allowed):
        # tokens past 32 * words are not covered by the mask: disallowed
        expected = [t in tokens and t < 32 * words for t in range(vocab)]
        assert unpacked[i].tolist() == expected


@pytest.fixture(params=["xgrammar", "torch"])
def bitmask_kernel(request, monkeypatch):
    """Both ways of applying a grammar mask: xgrammar's kernel and the torch unpack."""
    import replica.layers.sampler as sampler_module

    if request.param == "torch":
        monkeypatch.setattr(sampler_module, "_xgrammar_apply", None)
    elif sampler_module._xgrammar_apply is None:
        pytest.skip("xgrammar is not installed")
    return request.param


@pytest.mark.parametrize("vocab", [70, 100])  # 100: past the 3-word mask's 96 tokens
def test_bitmask_matches_the_reference_on_its_rows_only(bitmask_kernel, vocab):
    logits = _random_logits(5, vocab, seed=7)
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 0.0, 0.9, 0.0)]
    requests = [_request([1], [], p) for p in params]
    masked_rows = {0: {1, 31, 33, 64, 68, 69}, 3: set(range(0, 70, 4)) | {31, 69, 95}}
    bitmask = _pack_bitmask(list(masked_rows.values()), words=3)

    def reference(row, p, request, i):
        if i not in masked_rows:
            return list(row)
        return [x if t in masked_rows[i] and t < 96 else INF for t, x in enumerate(row)]

    _check_against_reference(
        logits,
        params,
        requests,
        reference,
        [i in masked_rows for i in range(5)],
        token_bitmask=(list(masked_rows), bitmask),
    )


@pytest.mark.parametrize("vocab", [70, 100])
def test_bitmask_by_logits_row_masks_only_its_rows(bitmask_kernel, vocab):
    """A mask with a row per logits row (the runner's reused buffer): only the named rows are
    read, whatever the others hold, and the result is the compact layout's."""
    logits = _random_logits(5, vocab, seed=7)
    masked_rows = {0: {1, 31, 33, 64, 68, 69}, 3: set(range(0, 70, 4)) | {31, 69, 95}}
    compact = _pack_bitmask(list(masked_rows.values()), words=3)
    by_row = torch.zeros(5, 3, dtype=torch.int32)  # stale rows: would allow nothing
    by_row[list(masked_rows)] = compact
    params = [SamplingParams(temperature=0.0)] * 5
    expected = process_logits(logits, params, token_bitmask=(list(masked_rows), compact))
    got = process_logits(logits, params, token_bitmask=(list(masked_rows), by_row))
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 2, 4]], logits[[1, 2, 4]])


def test_bitmask_allowing_one_token_forces_it_at_temperature_one(bitmask_kernel):
    rows = 400
    logits = _random_logits(rows, seed=8)
    logits[:, 13] = -20.0  # the most unlikely token
    params = [SamplingParams(temperature=1.0)] * rows
    forced = list(range(0, rows, 2))
    bitmask = _pack_bitmask([{13}] * len(forced), words=2)
    out = sampler(
        logits,
        params,
        [None] * rows,
        torch.Generator().manual_seed(0),
        token_bitmask=(forced, bitmask),
    ).token_ids
    assert {out[i] for i in forced} == {13}
    assert 13 not in out[1::2] and len(set(out[1::2])) > 10


def test_all_processors_compose_in_the_documented_order():
    vocab = 40
    logits = _random_logits(4, vocab, seed=9)
    logits[0, 6] = -1.0  # bias then repetition: (-1 + 5) / 2 = 2, not -1 * 2 + 5 = 3
    params = [
        SamplingParams(
            temperature=0.0,
            logit_bias={6: 5.0, 7: 1.0},
            repetition_penalty=2.0,
            frequency_penalty=0.5,
            presence_penalty=0.25,
            min_tokens=3,
        ),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=1.0, logit_bias={8: -3.0}, frequency_penalty=1.0, min_tokens=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, stop_token_ids=[3], min_tokens=9),
    ]
    outputs = [[6, 6, 7, 8], [1, 2], [8, 8, 9], [3, 4, 5]]
    requests = [_request([6, 10, 11], o, p) for o, p in zip(outputs, params)]
    masked_rows = {0: set(range(2, 30)), 2: set(range(0, 40, 2))}

    def reference(row, p, request, i):
        row = list(row)
        if i in masked_rows:  # 2. grammar
            row = [x if t in masked_rows[i] else INF for t, x in enumerate(row)]
        for t, b in (p.logit_bias or {}).items():  # 3. logit_bias
            row[t] += b
        if request.num_output_tokens < p.min_tokens:  # 4. min_tokens
            for t in set(request.eos_token_ids) | set(p.stop_token_ids):
                row[t] = INF
        return _reference_penalties(row, p, request, i)  # 5. repetition, 6. frequency/presence

    processed = _check_against_reference(
        logits,
        params,
        requests,
        reference,
        [True, False, True, True],
        token_bitmask=(list(masked_rows), _pack_bitmask(list(masked_rows.values()), 2)),
    )
    assert processed[0, 6].item() == pytest.approx(2.0 - 0.5 * 2 - 0.25)


def test_logprobs_stay_raw_with_processors():
    logits = _random_logits(2, seed=10)
    params = [
        SamplingParams(temperature=0.0, logprobs=2, logit_bias={5: 50.0}, presence_penalty=1.0),
        SamplingParams(temperature=0.5, logprobs=0),
    ]
    requests = [_request([1], [5, 6], p) for p in params]
    raw = logits.clone()
    out = sampler(logits, params, [None, None], torch.Generator(), histories=requests)
    assert torch.equal(logits, raw)  # the caller's tensor is not modified
    assert out.token_ids[0] == 5
    lp, top = out.logprobs[0]
    reference = torch.log_softmax(raw, dim=-1)
    assert lp == pytest.approx(reference[0, 5].item())
    assert list(top) == reference[0].topk(2).indices.tolist()


# -- end to end through the runner ------------------------------------------------------------
SEEDED = SamplingParams(
    temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True
)
PROMPT = [17, 230, 45, 99, 301, 7, 12, 480, 66, 5, 250]


def _others(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[(31 * i + 7 * j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(n)]
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=10 + i, ignore_eos=True, seed=i if i % 2 else None
        )
        for i in range(n)
    ]
    return prompts, params


def test_seeded_request_reproduces_across_runs_batches_and_preemption(
    tiny_llama_dir, run_generation
):
    alone = run_generation(tiny_llama_dir, [PROMPT], SEEDED, block_size=4).outputs[0]
    assert run_generation(tiny_llama_dir, [PROMPT], SEEDED, block_size=4).outputs[0] == alone

    prompts, params = _others(7)
    crowded = run_generation(
        tiny_llama_dir,
        prompts[:3] + [PROMPT] + prompts[3:],
        params[:3] + [SEEDED] + params[3:],
        block_size=4,
        max_num_batched_tokens=16,
    )
    assert crowded.outputs[3] == alone

    # the seeded request is the newest, so the pool squeeze preempts it after it has sampled
    # some tokens: its draws depend on positions alone, so recompute changes nothing
    long_prompts = [[(31 * i + 7 * j) % 500 + 3 for j in range(3 + 2 * i)] for i in range(3)]
    long_params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)] * 3
    squeezed = run_generation(
        tiny_llama_dir,
        long_prompts + [PROMPT],
        long_params + [SEEDED],
        block_size=4,
        num_kv_blocks=14,
        max_num_batched_tokens=32,
    )
    assert squeezed.requests[-1].num_preemptions > 0
    assert squeezed.outputs[-1] == alone

    other_seed = SamplingParams(**{**SEEDED.__dict__, "seed": 4321})
    assert run_generation(tiny_llama_dir, [PROMPT], other_seed, block_size=4).outputs[0] != alone


def test_identical_seeded_requests_in_one_batch_draw_identical_tokens(
    tiny_llama_dir, run_generation
):
    run = run_generation(
        tiny_llama_dir, [PROMPT, PROMPT], [SEEDED, SEEDED], request_ids=["a", "b"], block_size=4
    )
    assert run.outputs[0] == run.outputs[1]
    assert not hasattr(run.runner, "generators")  # no per-request sampling state to leak


def test_greedy_logprobs_match_transformers(tiny_qwen2_dir, run_generation):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=4, ignore_eos=True)
    run = run_generation(tiny_qwen2_dir, [PROMPT], params, block_size=4)
    output, logprobs = run.outputs[0], run.logprobs[0]
    assert len(logprobs) == len(output) == 6
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output])).logits[0]
    reference = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    for i, (token, (lp, top)) in enumerate(zip(output, logprobs)):
        assert lp == pytest.approx(reference[i, token].item(), abs=1e-4)
        assert len(top) == 4 and next(iter(top)) == token  # greedy: the top entry
        assert all(v <= 0.0 and not math.isnan(v) for v in top.values())


def _sorted_cut(row: torch.Tensor, k: int, p: float) -> set[int]:
    """The tokens top-k then top-p keep, by the definition: a sort of the whole row."""
    vocab = row.shape[0]
    k = k if 0 < k < vocab else vocab
    values, order = row.double().sort(descending=True)
    values[k:] = float("-inf")
    probs = torch.softmax(values, dim=0)
    mass_before = probs.cumsum(0) - probs
    keep = (values > float("-inf")) & ((mass_before < p) | (p >= 1.0))
    return set(order[keep].tolist())


# peaked: the nucleus is among the first candidates; 3.0: among the second (8x) ones for p=0.9;
# flat: past them, the row is sorted whole
@pytest.mark.parametrize("scale", [8.0, 3.0, 0.05])
def test_top_k_top_p_cut_matches_a_full_sort(scale):
    vocab = 20_000  # wide enough that the rows are cut over their topk candidates
    rows = torch.randn(8, vocab, generator=torch.Generator().manual_seed(11)) * scale
    rows[5, 100:] = float("-inf")  # a grammar-masked row
    top_ks = [0, 40, 0, 3, 1, 0, 0, 200]
    top_ps = [0.9, 1.0, 0.5, 0.8, 1.0, 0.95, 1.0, 0.99]
    cut = sampler_module._top_k_top_p(rows, top_ks, top_ps)
    for i in range(len(rows)):
        kept = {int(t) for t in torch.nonzero(cut[i] > float("-inf"))[:, 0]}
        if top_ks[i] == 0 and top_ps[i] == 1.0:
            assert torch.equal(cut[i], rows[i])  # a row that cuts nothing is left as it was
        else:
            assert kept == _sorted_cut(rows[i], top_ks[i], top_ps[i]), i
            # the kept tokens keep their logits
            assert torch.equal(cut[i][sorted(kept)], rows[i][sorted(kept)])


def test_greedy_takes_the_first_of_tied_maxima():
    logits = torch.zeros(3, 50_000)
    logits[0, [7, 40_000]] = 1.0
    logits[1, [33_000, 49_999]] = 2.0
    out = sampler(logits, [SamplingParams(temperature=0.0)] * 3, [None] * 3)
    assert out.token_ids == [7, 33_000, 0]


def test_writable_logits_are_processed_in_place_and_sample_the_same():
    logits = _random_logits(4, seed=12)
    params = [SamplingParams(temperature=0.0, logit_bias={3: 50.0})] + [
        SamplingParams(temperature=0.0)
    ] * 3
    kept = logits.clone()
    expected = sampler(logits, params, [None] * 4).token_ids
    assert torch.equal(logits, kept)  # not handed over: left as it was
    assert sampler(logits, params, [None] * 4, logits_writable=True).token_ids == expected
    assert expected[0] == 3 and logits[0, 3] == kept[0, 3] + 50.0


def test_nucleus_width_holds_the_nucleus_and_is_not_the_whole_vocabulary():
    rows = torch.randn(6, 20_000, generator=torch.Generator().manual_seed(13)) * 3.0
    logprobs = torch.log_softmax(rows, dim=-1)
    top_ps = [0.5, 0.8, 0.9, 0.95, 0.99, 0.9]
    widths = sampler_module._nucleus_widths(logprobs, top_ps)
    for i, p in enumerate(top_ps):
        nucleus = len(_sorted_cut(rows[i], 0, p))
        assert nucleus < widths[i] < 4 * nucleus + 1000, (i, nucleus, widths[i])
