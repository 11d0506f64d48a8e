"""Sampler semantics (greedy, temperature, top-k, top-p, logprobs) and seeded sampling that
reproduces across runs, batch compositions and preemption."""

from __future__ import annotations

import math

import pytest
import torch

from replica.layers.sampler import Sampler
from replica.request import SamplingParams

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
        generators = {i: torch.Generator().manual_seed(params[i].seed) for i in (0, 1, 2)}
        default = torch.Generator().manual_seed(99)
        out = []
        for _ in range(steps):
            result = sampler(
                logits[batch_rows],
                [params[i] for i in batch_rows],
                [generators.get(i) for i in batch_rows],
                default,
            )
            out.append(result.token_ids[batch_rows.index(0)])
        return out

    alone = draws([0])
    assert draws([3, 0, 1]) == alone
    assert draws([2, 4, 1, 3, 0]) == alone
    assert len(set(alone)) > 1  # really sampled, not greedy


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
    # some tokens: its generator must survive that
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


def test_runner_drops_generators_of_finished_requests_only(tiny_llama_dir, run_generation):
    run = run_generation(
        tiny_llama_dir, [PROMPT, PROMPT], [SEEDED, SEEDED], request_ids=["a", "b"], block_size=4
    )
    assert run.outputs[0] == run.outputs[1]
    runner = run.runner
    # the scheduler reports finished ids on the step after they end; none ran after the last
    assert set(runner.generators) <= {"a", "b"}
    runner.execute(run.scheduler.schedule())  # an empty step still delivers finished ids
    assert runner.generators == {}


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
