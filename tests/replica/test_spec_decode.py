"""Speculative decoding by prompt lookup (replica/spec_decode.py): the proposer's lookup, the
scheduler and runner around drafts (checked slot by slot by the fake runner), and greedy
outputs token-identical to transformers with drafts accepted and rejected on a real model."""

from __future__ import annotations

import pytest

from replica.config import EngineConfig
from replica.request import Request, SamplingParams
from replica.runner import verify_greedy_drafts
from replica.scheduler import Scheduler
from replica.spec_decode import NgramProposer, speculation_allowed
from tests.fake_runner import FakeRunner
from tests.helpers import scheduler_request
from tests.replica.test_model_parity import expected_outputs, greedy_params, mixed_prompts
from tests.replica.test_scheduler import run_to_completion

EOS = frozenset({0})


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model_dir(request, tiny_llama_dir, tiny_qwen2_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[request.param]


def _request(tokens, rid="r", **params) -> Request:
    params.setdefault("temperature", 0.0)
    return scheduler_request(rid, tokens, SamplingParams(**params), EOS)


def test_proposer_takes_the_longest_trailing_ngram_at_its_latest_occurrence():
    proposer = NgramProposer(4, lookup_max=3, lookup_min=1)
    # trailing 3-gram (7, 8, 9) occurred at 1..3 (followed by 5 6) and the 1-gram 9 also at 6
    tokens = [1, 7, 8, 9, 5, 6, 9, 2, 7, 8, 9]
    assert proposer.propose(_request(tokens), 4) == [5, 6, 9, 2]
    assert proposer.propose(_request(tokens, rid="s"), 2) == [5, 6]  # capped by max_len
    assert proposer.propose(_request(tokens, rid="t"), 0) == []
    # only the 1-gram 4 recurs: its latest earlier occurrence is followed by 3
    assert proposer.propose(_request([4, 1, 4, 3, 2, 4], rid="w"), 2) == [3, 2]
    assert proposer.propose(_request([1, 2, 3, 4], rid="u"), 4) == []  # nothing recurs
    # a run of one token drafts more of it (the match may overlap the tail)
    assert proposer.propose(_request([5, 5, 5], rid="v"), 3) == [5]


def test_proposer_index_grows_with_the_sequence_and_adapts_the_length():
    proposer = NgramProposer(3, lookup_max=2, lookup_min=2)
    request = _request([1, 2, 3, 4])
    assert proposer.propose(request, 3) == []
    request.all_token_ids += [1, 2]  # now (1, 2) recurs: its earlier occurrence is followed by 3
    assert proposer.propose(request, 3) == [3, 4, 1]
    proposer.record("r", 3, 1)  # one of three accepted: the next draft is one token
    request.all_token_ids += [3, 9]
    request.all_token_ids += [1, 2]
    assert proposer.propose(request, 3) == [3]
    proposer.record("r", 1, 1)  # all accepted: it grows again
    assert proposer.propose(request, 3) == [3, 9]
    assert proposer.stats.num_draft_tokens == 4 and proposer.stats.num_accepted_tokens == 2
    proposer.forget("r")
    assert proposer.num_tracked() == 0


def test_only_plain_greedy_requests_speculate():
    assert speculation_allowed(SamplingParams(temperature=0.0))
    assert speculation_allowed(SamplingParams(temperature=0.0, stop=["x"], stop_token_ids=[3]))
    for params in (
        SamplingParams(),  # temperature 1
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.0, prompt_logprobs=0),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
        SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4),
    ):
        assert not speculation_allowed(params), params


def test_verification_keeps_the_matching_prefix_and_the_models_next_token():
    import torch

    def rows(*argmaxes):
        logits = torch.zeros(len(argmaxes), 10)
        for i, token in enumerate(argmaxes):
            logits[i, token] = 1.0
        return logits

    # draft [4, 5, 6]: the model agrees on 4 and 5, then says 7 where the draft says 6
    assert verify_greedy_drafts(rows(4, 5, 7, 1), [[4, 5, 6]]) == [[4, 5, 7]]
    # all accepted: plus the model's token after the last draft token
    assert verify_greedy_drafts(rows(4, 5, 8), [[4, 5]]) == [[4, 5, 8]]
    # first rejected: only the model's own token; two requests' rows in order
    assert verify_greedy_drafts(rows(2, 9, 3, 3), [[1], [3]]) == [[2], [3, 3]]


@pytest.mark.parametrize(
    "caching,num_blocks,budget,threshold",
    [(True, 256, 2048, 0), (False, 256, 7, 0), (True, 14, 64, 0), (False, 12, 2048, 0),
     (True, 256, 2048, 1)],
    ids=["prefix-cache", "small-budget", "preempting-cached", "preempting", "1-token-chunks"],
)  # fmt: skip
def test_drafted_steps_give_each_request_its_solo_tokens(caching, num_blocks, budget, threshold):
    """Repeating outputs (drafts accepted), a model that ignores the pattern at places (drafts
    rejected), stop tokens inside accepted drafts, preemption and chunked prefill: every
    request ends with exactly the tokens it gets alone, one token per step; the fake runner
    checks every slot a step reads holds the request's true prefix (stale draft KV never read)."""
    config = EngineConfig(
        block_size=4,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        long_prefill_token_threshold=threshold,  # 1: prefill chunks of 1 token, never drafted
        num_speculative_tokens=4,
        prompt_lookup_min=1,
        prompt_lookup_max=3,
    )
    sched = Scheduler(config, num_blocks, 4096)
    forced = {
        "cycle": [5, 6, 7] * 20,
        "broken": ([5, 6, 7] * 3 + [9]) * 6,  # the pattern breaks every 10th token
        "stops": [8, 9] * 6 + [3, 8, 9],  # stop token 3 arrives inside a drafted run
        "eos": [4, 4, 4, 4, 4, 0, 4],
    }
    params = {
        "cycle": dict(max_tokens=40, ignore_eos=True),
        "broken": dict(max_tokens=37, ignore_eos=True),
        "stops": dict(max_tokens=40, stop_token_ids=[3]),
        "eos": dict(max_tokens=40),
        "random": dict(max_tokens=30),  # the fake model's own tokens: rare matches
        "sampled": dict(max_tokens=20, temperature=1.0),  # never drafts
    }
    runner = FakeRunner(4, vocab_size=12, forced_tokens=forced, num_kv_blocks=num_blocks)
    prompts = {rid: [5, 6, 7, 5, 6, 1 + i, 2, 3][: 5 + i % 3] for i, rid in enumerate(params)}
    for rid, p in params.items():
        sched.add_request(_request(prompts[rid], rid, **p))
    done = run_to_completion(sched, runner)
    for rid, p in params.items():
        request_params = SamplingParams(**{"temperature": 0.0, **p})
        alone = runner.generate_alone(rid, prompts[rid], request_params, EOS, 4096)
        assert done[rid] == alone, rid
    assert done["stops"][0][-1] == 3 and done["eos"][0][-1] == 0
    stats = sched.proposer.stats
    # drafts both accepted and rejected, and fewer steps than tokens
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert runner.num_steps < sum(len(tokens) for tokens, _ in done.values())
    assert sched.proposer.num_tracked() == 0
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    if num_blocks < 20:
        assert sched.num_preemptions_total > 0


def test_drafts_respect_max_tokens_and_the_step_budget():
    config = EngineConfig(block_size=4, max_num_batched_tokens=3, num_speculative_tokens=8)
    sched = Scheduler(config, 64, 4096)
    runner = FakeRunner(4, vocab_size=12, forced_tokens={"r": [1, 2] * 20})
    sched.add_request(_request([1, 2, 1, 2], "r", max_tokens=7, ignore_eos=True))
    seen = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= 3
        for s in out.scheduled:
            # the bonus token must fit too: never draft past max_tokens - 1
            assert s.request.num_tokens + len(s.draft) < s.request.max_total_tokens
            seen.append(len(s.draft))
        result = runner.execute(out)
        sched.update_from_output(out, result.sampled, spec_tokens=result.spec_tokens)
    assert max(seen) == 2  # the budget of 3 tokens: the last token and 2 drafted
    assert runner.num_draft_tokens > 0


def test_real_model_with_drafts_matches_transformers(tiny_model_dir, run_generation):
    """Greedy fp32 with prompt-lookup drafts on the tiny checkpoints: token-identical to
    transformers one token at a time, with chunked prefill (8 tokens a step), prefix hits, a
    small KV pool that preempts, and a sampled request in the same batches."""
    rng_prompts = mixed_prompts(6, [9, 17, 30, 5])
    # prompts that repeat themselves: the drafts come from them
    prompts = [p * 3 for p in rng_prompts[:2]] + rng_prompts[2:]
    prompts.append(prompts[0][:20] + [7, 7, 7])  # shares cached blocks with the first
    max_tokens = [24, 18, 30, 20, 16]
    params = [greedy_params(n) for n in max_tokens]
    run = run_generation(
        tiny_model_dir,
        prompts + [rng_prompts[3]],
        params + [SamplingParams(temperature=1.0, max_tokens=12, seed=3)],
        block_size=4,
        num_kv_blocks=20,  # the longest request needs 18
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        num_speculative_tokens=4,
    )
    expected = expected_outputs(tiny_model_dir, prompts, max_tokens)
    assert run.outputs[:-1] == expected
    assert run.scheduler.proposer.stats.num_accepted_tokens > 0, run.scheduler.proposer.stats
    assert run.scheduler.num_preemptions_total > 0
    # no drafts while a request waits for its first token, which the small pool makes common:
    # a roomy pool lets drafts run beside one another, accepted and rejected
    roomy = run_generation(
        tiny_model_dir, prompts, params, block_size=4, num_kv_blocks=256,
        max_num_batched_tokens=64, enable_prefix_caching=True, num_speculative_tokens=4,
    )  # fmt: skip
    assert roomy.outputs == expected
    stats = roomy.scheduler.proposer.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert roomy.num_steps < sum(max_tokens)


def test_llm_speculation_leaves_every_output_unchanged(tiny_llama_dir):
    """The offline LLM with drafts on and off, a mix of greedy (drafted; one ends at a stop
    string that appears inside an accepted draft), greedy with logprobs and seeded sampled
    requests: the same tokens, text, logprobs and finish reasons."""
    from replica.engine import LLM

    prompts = [p * 2 for p in mixed_prompts(8, [6, 11, 14])]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def llm(k):
        return LLM(model=tiny_llama_dir, device="cpu", num_kv_blocks=64, block_size=4,
                   num_speculative_tokens=k)  # fmt: skip

    with llm(0) as plain:
        text = plain.generate(prompts[:1], greedy)[0].text
    stop = text[len(text) // 2 :][:3]  # ends the first request halfway through its output
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0.8, max_tokens=16, seed=11),
        greedy,
    ]
    prompts.append(prompts[1])
    results = []
    for k in (0, 3):
        with llm(k) as engine:
            outs = engine.generate(prompts, params)
            results.append(
                [(o.output_token_ids, o.text, o.finish_reason, o.logprobs) for o in outs]
            )
            if k:
                assert engine.engine.scheduler.proposer.stats.num_accepted_tokens > 0
    assert results[0] == results[1]
    assert results[0][0][2] == "stop" and len(results[0][0][0]) < 24


def test_a_stop_string_inside_a_multi_token_delta_ends_the_output_at_its_token(
    tiny_tokenizer_dir,
):
    """Several tokens arrive in one step (an accepted draft); a stop string completed by the
    second one ends the output there: later tokens are dropped from the ids, the count and
    the logprobs, as if they had come one a step."""
    from transformers import AutoTokenizer

    from replica.engine import OutputProcessor
    from replica.request import RequestOutput

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    ids = tokenizer.encode(" alpha beta gamma delta", add_special_tokens=False)
    assert len(ids) >= 4
    stop = tokenizer.decode(ids[1:2]).strip()
    processor = OutputProcessor(tokenizer)
    processor.add("r", [1], SamplingParams(stop=[stop]))
    out = RequestOutput("r", list(ids), "", 1, len(ids), new_logprobs=[(-0.1, {})] * len(ids))
    out, stopped = processor.process(out)
    assert stopped and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.new_token_ids == ids[:2] and out.num_output_tokens == 2
    assert len(out.new_logprobs) == 2
    # the delta's last token also ended the request (max_tokens): the stop string still wins,
    # and the engine has nothing left to finish
    processor.add("s", [1], SamplingParams(stop=[stop]))
    late = RequestOutput("s", list(ids), "", 1, len(ids), finish_reason="length")
    late, stopped = processor.process(late)
    assert not stopped and (late.finish_reason, late.stop_reason) == ("stop", stop)
    assert late.new_token_ids == ids[:2] and late.num_output_tokens == 2
    assert stop not in out.new_text and out.new_text.strip() == tokenizer.decode(ids[:1]).strip()


def test_no_drafts_in_a_step_that_carries_a_prefill():
    """A request before its first token (its prompt admitted or chunked in the step, or
    waiting for a seat): no request drafts, so that first token is not held up by the others'
    drafts; drafting resumes once it has its first token."""
    config = EngineConfig(
        block_size=4, max_num_batched_tokens=8, num_speculative_tokens=4,
        prompt_lookup_min=1, prompt_lookup_max=3,
    )  # fmt: skip
    sched = Scheduler(config, 256, 4096)
    runner = FakeRunner(4, vocab_size=12, forced_tokens={"a": [5, 6, 7] * 30})
    sched.add_request(_request([5, 6, 7, 5, 6], "a", max_tokens=60, ignore_eos=True))

    def step():
        out = sched.schedule()
        result = runner.execute(out)
        sched.update_from_output(out, result.sampled, spec_tokens=result.spec_tokens)
        return out

    while not any(s.draft for s in step().scheduled):
        pass  # "a" decodes and drafts
    sched.add_request(_request([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], "b", max_tokens=3))
    b, drafts = sched.requests["b"], []
    while b.num_computed_tokens < b.num_prompt_tokens:  # 11 tokens, a budget of 8: 2 steps
        drafts.append(sum(len(s.draft) for s in step().scheduled))
    assert drafts == [0, 0]
    assert any(s.draft for s in step().scheduled if s.request_id == "a")  # drafting again
