"""Resuming a request on another replica (migration, request.Resume): a request cut after k
tokens and sent again with the tokens and text its client had continues exactly as the
undisturbed run did: the same tokens, the same text (no character repeated or lost, a stop
string across the cut found), the same finish, cumulative counts; and a resume the engine
cannot continue is refused, naming the value at fault."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import pytest

from replica.config import EngineConfig
from replica.engine import Engine
from replica.request import (
    EngineRequest,
    LoRARequest,
    RequestOutput,
    RequestRejected,
    Resume,
    SamplingParams,
    StructuredOutput,
)
from replica.tiny_models import TINY_EOS_ID
from tests.replica.test_model_parity import mixed_prompts

PROMPTS = mixed_prompts(47, [5, 11, 3, 17, 8, 9])


def make_engine(model_dir, **fields) -> Engine:
    fields = {"device": "cpu", "block_size": 4, "num_kv_blocks": 256, "max_model_len": 256,
              **fields}  # fmt: skip
    return Engine(EngineConfig(model=str(model_dir), **fields))


@pytest.fixture(scope="module")
def origin(tiny_llama_dir):
    """The replica that runs requests undisturbed (and is 'lost' at each cut)."""
    engine = make_engine(tiny_llama_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    """The replica requests are resumed on: a fresh engine, its prefix cache its own."""
    engine = make_engine(tiny_llama_dir)
    yield engine
    engine.shutdown()


@dataclasses.dataclass
class Run:
    deltas: list[RequestOutput]  # every delta the client received, in order

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.new_token_ids]

    @property
    def text(self) -> str:
        return "".join(d.new_text for d in self.deltas)

    @property
    def logprobs(self) -> list:
        return [lp for d in self.deltas for lp in d.new_logprobs or []]

    @property
    def last(self) -> RequestOutput:
        return self.deltas[-1]

    def client_view(self, num_deltas: int) -> Resume:
        """What the client had after `num_deltas` deltas: the resume the ingress sends."""
        kept = self.deltas[:num_deltas]
        tokens = [t for d in kept for t in d.new_token_ids]
        return Resume(tokens, "".join(d.new_text for d in kept))


def run(engine: Engine, request: EngineRequest, alone: bool = True) -> Run:
    """Step `engine` until `request` finishes; the deltas it received. `alone`: the engine
    ran nothing else, so it must hold nothing afterwards."""
    engine.check_request(request)
    engine.add(request)
    deltas = []
    while not (deltas and deltas[-1].finished):
        assert engine.has_unfinished(), "the request vanished without a final delta"
        deltas += [o for o in engine.step() if o.request_id == request.request_id]
    if alone:
        assert engine.num_request_states == 0 and not engine.has_unfinished()
        assert engine.num_free_blocks == engine.num_kv_blocks  # nothing leaked
    return Run(deltas)


_ids = iter(range(10**9))


def request_of(prompt, params, resume=None, **fields) -> EngineRequest:
    return EngineRequest(list(prompt), params, f"r{next(_ids)}", resume=resume, **fields)


def assert_resumes_exactly(origin, target, prompt, params, cuts=None, **fields) -> Run:
    """Run undisturbed on `origin`; then for each cut (a number of deltas the client had
    received; all of them by default, 0 and the whole run included), resume on `target` and
    check that the client's concatenated stream equals the undisturbed one."""
    full = run(origin, request_of(prompt, params, **fields))
    cuts = range(len(full.deltas) + 1) if cuts is None else cuts
    for k in cuts:
        resume = full.client_view(k)
        rest = run(target, request_of(prompt, params, resume, **fields))
        where = f"cut after {k} deltas ({len(resume.output_token_ids)} tokens)"
        assert resume.output_token_ids + rest.tokens == full.tokens, where
        assert resume.output_text + rest.text == full.text, where
        assert rest.last.finish_reason == full.last.finish_reason, where
        assert rest.last.stop_reason == full.last.stop_reason, where
        assert rest.last.num_output_tokens == full.last.num_output_tokens, where
        assert all(d.num_prompt_tokens == len(prompt) for d in rest.deltas), where
        # prompt logprobs come with the first token: not again once the client has one
        if resume.output_token_ids or params.prompt_logprobs is None:
            assert all(d.prompt_logprobs is None for d in rest.deltas), where
        else:
            got, want = rest.deltas[0].prompt_logprobs, full.deltas[0].prompt_logprobs
            assert len(got) == len(want) == len(prompt) - 1, where
            for (got_lp, got_top), (want_lp, want_top) in zip(got, want):
                assert math.isclose(got_lp, want_lp, abs_tol=1e-4), where
                assert got_top.keys() == want_top.keys(), where
        if params.logprobs is not None:
            expected = full.logprobs[len(resume.output_token_ids) :]
            assert len(rest.logprobs) == len(expected) == len(rest.tokens), where
            for (got, got_top), (want, want_top) in zip(rest.logprobs, expected):
                assert math.isclose(got, want, abs_tol=1e-4), where
                assert got_top.keys() == want_top.keys(), where
    return full


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED_TOP_P = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
SEEDED_TOP_K = SamplingParams(temperature=1.0, top_k=20, seed=12, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        SEEDED_TOP_P,
        SEEDED_TOP_K,
        SamplingParams(
            temperature=0.9,
            seed=3,
            max_tokens=10,
            ignore_eos=True,
            presence_penalty=0.8,
            frequency_penalty=0.6,
            repetition_penalty=1.4,
        ),
        SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2
        ),
    ],  # fmt: skip
    ids=["greedy", "seeded-top-p", "seeded-top-k", "penalties", "logprobs"],
)
def test_a_resumed_request_continues_as_the_undisturbed_one(origin, target, params):
    full = assert_resumes_exactly(origin, target, PROMPTS[1], params)
    assert full.last.num_output_tokens == params.max_tokens
    if params.temperature:
        # really sampled: another seed draws another stream
        other = dataclasses.replace(params, seed=params.seed + 1)
        assert run(origin, request_of(PROMPTS[1], other)).tokens != full.tokens


def test_a_seeded_request_draws_by_position_whatever_the_batch(origin, target):
    """The same seeded stream alone, in a crowd, and resumed in a crowd."""
    alone = run(origin, request_of(PROMPTS[0], SEEDED_TOP_P))
    crowd = [request_of(p, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
             for p in PROMPTS[2:]]  # fmt: skip
    for k in (0, 4):
        for other in crowd:
            target.add(dataclasses.replace(other, request_id=f"{other.request_id}-{k}"))
        resumed = request_of(PROMPTS[0], SEEDED_TOP_P, alone.client_view(k))
        resumed = run(target, resumed, alone=False)
        while target.has_unfinished():
            target.step()
        assert target.num_free_blocks == target.num_kv_blocks
        assert alone.client_view(k).output_token_ids + resumed.tokens == alone.tokens


def test_a_resumed_seeded_request_survives_preemption(tiny_llama_dir, origin):
    """A KV pool too small for all: the resumed request is preempted after it sampled (it is
    the newest) and recomputed again, its stream unchanged."""
    alone = run(origin, request_of(PROMPTS[0], SEEDED_TOP_K))
    small = make_engine(tiny_llama_dir, num_kv_blocks=14, max_num_batched_tokens=32)
    try:
        others = [request_of(p, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True))
                  for p in mixed_prompts(5, [7, 9, 11])]  # fmt: skip
        for other in others:
            small.add(other)
        small.step()
        state = small.add(request_of(PROMPTS[0], SEEDED_TOP_K, alone.client_view(3)))
        tokens = []
        while small.has_unfinished():
            for out in small.step():
                if out.request_id == state.request_id:
                    tokens += out.new_token_ids
        assert state.num_preemptions > 0
        assert alone.client_view(3).output_token_ids + tokens == alone.tokens
    finally:
        small.shutdown()


def test_min_tokens_counts_the_resumed_output(origin, target):
    """EOS pushed up by logit_bias: banned until min_tokens outputs, then sampled at once; a
    request resumed before that point must still ban it, counting its resumed tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6,
                            logit_bias={TINY_EOS_ID: 30.0})  # fmt: skip
    full = assert_resumes_exactly(origin, target, PROMPTS[3], params)
    assert full.tokens[-1] == TINY_EOS_ID and len(full.tokens) == 7
    assert full.last.finish_reason == "stop"


def _stop_string_across(text: str, at: int, length: int = 3) -> str:
    stop = text[at : at + length]
    assert len(stop) == length and stop.strip() and text.find(stop) == at, (text, at)
    return stop


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_the_cut_is_found(origin, target, include):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    text = run(origin, request_of(PROMPTS[4], greedy)).text
    # a stop string some characters into the text: cuts before, inside and after it
    at = next(i for i in range(6, len(text) - 3) if text.find(text[i : i + 3]) == i)
    params = dataclasses.replace(greedy, stop=[_stop_string_across(text, at)],
                                 include_stop_str_in_output=include)  # fmt: skip
    full = assert_resumes_exactly(origin, target, PROMPTS[4], params)
    assert full.last.finish_reason == "stop" and full.last.stop_reason == params.stop[0]
    assert full.text == (text[: at + 3] if include else text[:at])
    # the lost front held text back at some cut (a possible start of the stop string): the
    # resumed text is then shorter than the decode of the resumed tokens
    views = [full.client_view(k) for k in range(len(full.deltas))]
    decoded = [origin.tokenizer.decode(v.output_token_ids) for v in views]
    assert any(len(v.output_text) < len(d) for v, d in zip(views, decoded))


def test_a_cut_inside_a_multibyte_character(origin, target):
    """A regex of two-byte characters written one byte token at a time: cuts between the two
    bytes of a character resume into the same text, and a stop string of two such
    characters across the cut is found."""
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12,
                            structured=StructuredOutput("regex", "[éüñ]{5}x"))  # fmt: skip
    full = assert_resumes_exactly(origin, target, PROMPTS[5], params)
    tokenizer = origin.tokenizer
    pieces = [tokenizer.decode(full.tokens[:i]) for i in range(1, len(full.tokens))]
    assert any(p.endswith("\ufffd") for p in pieces), "no cut falls inside a character"
    assert full.text.rstrip("x") and set(full.text[:5]) <= set("éüñ")
    text = full.text
    stop = text[2:4]
    stopped = assert_resumes_exactly(
        origin, target, PROMPTS[5], dataclasses.replace(params, stop=[stop])
    )
    assert stopped.last.finish_reason == "stop" and stopped.text == text[: text.find(stop)]


def test_a_json_schema_output_continues_its_grammar(origin, target):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
              "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"]}  # fmt: skip
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=60,
                            structured=StructuredOutput("json", json.dumps(schema)))  # fmt: skip
    full = assert_resumes_exactly(origin, target, PROMPTS[2], params, cuts=range(0, 40, 3))
    assert full.last.finish_reason == "stop"
    assert set(json.loads(full.text)) == {"name", "age"}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=20, min_tokens=3, logit_bias={TINY_EOS_ID: 30.0}
        ),
        SamplingParams(temperature=0.0, max_tokens=20, logit_bias={77: 40.0}, stop_token_ids=[77]),
    ],  # fmt: skip
    ids=["max-tokens", "eos", "stop-token"],
)
def test_a_resume_whose_tokens_end_the_request_finishes_at_once(origin, target, params):
    full = run(origin, request_of(PROMPTS[0], params))
    num_resumed = target.stats().num_resumed_total
    resumed = request_of(PROMPTS[0], params, Resume(full.tokens, full.text))
    rest = run(target, resumed)
    assert len(rest.deltas) == 1 and rest.tokens == [] and rest.text == ""
    assert rest.last.finish_reason == full.last.finish_reason
    assert rest.last.stop_reason == full.last.stop_reason
    assert rest.last.num_output_tokens == len(full.tokens)
    assert target.stats().num_resumed_total == num_resumed + 1


def test_spec_decode_on_a_resumed_greedy_request(tiny_llama_dir, origin):
    """Prompt lookup drafts for a resumed greedy request (its output repeats its prompt)."""
    prompt = PROMPTS[1] * 4
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = run(origin, request_of(prompt, params))
    spec = make_engine(tiny_llama_dir, num_speculative_tokens=3)
    try:
        for k in (0, 5, 13):
            rest = run(spec, request_of(prompt, params, full.client_view(k)))
            assert full.client_view(k).output_token_ids + rest.tokens == full.tokens
            assert full.client_view(k).output_text + rest.text == full.text
        assert spec.stats().spec_num_drafts > 0
    finally:
        spec.shutdown()


def test_a_resumed_request_keeps_its_lora_adapter(tiny_llama_dir, tmp_path):
    from replica.tiny_lora import build_tiny_adapter

    path = build_tiny_adapter(tiny_llama_dir, tmp_path / "adapter", rank=4, seed=3, scale=0.3)
    lora = LoRARequest("ad", str(path))
    engines = [make_engine(tiny_llama_dir, enable_lora=True, max_lora_rank=8) for _ in (0, 1)]
    try:
        base = run(engines[0], request_of(PROMPTS[2], GREEDY))
        full = assert_resumes_exactly(*engines, PROMPTS[2], GREEDY, cuts=(0, 4, 9), lora=lora)
        assert full.tokens != base.tokens  # the adapter changes the output
    finally:
        for engine in engines:
            engine.shutdown()


def test_resume_through_the_engine_core_process(tiny_llama_dir, origin):
    from replica.engine.core_client import ProcessEngine

    params = dataclasses.replace(SEEDED_TOP_P, max_tokens=14, stop=["zz"], logprobs=1)
    full = run(origin, request_of(PROMPTS[4], params))
    text = full.text
    at = next(i for i in range(4, len(text) - 2) if text.find(text[i : i + 2]) == i)
    params = dataclasses.replace(params, stop=[text[at : at + 2]])
    full = run(origin, request_of(PROMPTS[4], params))
    cuts = (0, 3, len(full.deltas) - 1, len(full.deltas))

    async def body():
        engine = ProcessEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu",
                                            block_size=4, num_kv_blocks=256, max_model_len=256))  # fmt: skip
        try:
            runs = []
            for k in cuts:
                deltas = [d async for d in engine.generate(
                    request_of(PROMPTS[4], params, full.client_view(k)))]  # fmt: skip
                runs.append(Run(deltas))
            with pytest.raises(RequestRejected, match="15 tokens, more than max_tokens=14"):
                too_long = Resume([9] * 15, "")
                [d async for d in engine.generate(request_of(PROMPTS[4], params, too_long))]
            with pytest.raises(RequestRejected, match="differs from the decode"):
                wrong = Resume(full.tokens[:2], "not it")
                [d async for d in engine.generate(request_of(PROMPTS[4], params, wrong))]
            assert engine.num_unfinished() == 0
            return runs
        finally:
            engine.shutdown()

    runs = asyncio.run(asyncio.wait_for(body(), 120))
    for k, rest in zip(cuts, runs):
        resume = full.client_view(k)
        assert resume.output_token_ids + rest.tokens == full.tokens, k
        assert resume.output_text + rest.text == full.text, k
        assert rest.last.finish_reason == full.last.finish_reason == "stop", k
        assert rest.last.num_output_tokens == full.last.num_output_tokens, k


def test_resumed_requests_are_counted(target):
    before = target.stats()
    full = run(target, request_of(PROMPTS[0], GREEDY))
    run(target, request_of(PROMPTS[0], GREEDY, full.client_view(4)))
    run(target, request_of(PROMPTS[0], GREEDY, full.client_view(0)))  # moved before a token
    after = target.stats()
    assert after.num_resumed_total == before.num_resumed_total + 2
    assert after.num_resumed_tokens_total == before.num_resumed_tokens_total + 4


def test_the_resumed_requests_counter_is_exported(tiny_llama_dir):
    from replica.metrics import EngineMetrics

    engine = make_engine(tiny_llama_dir)
    try:
        metrics = EngineMetrics(engine, "m", "r0")
        full = run(engine, request_of(PROMPTS[0], GREEDY))
        run(engine, request_of(PROMPTS[0], GREEDY, full.client_view(2)))
        text = metrics.exposition().decode()
        assert 'stepserve:resumed_requests_total{model_name="m",replica="r0"} 1.0' in text
    finally:
        engine.shutdown()


# -- refused resumes ---------------------------------------------------------------------------


def test_a_resume_longer_than_max_tokens_is_refused(target):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(RequestRejected, match=r"resumed output has 5 tokens, more than "
                       r"max_tokens=4") as caught:  # fmt: skip
        target.check_request(request_of(PROMPTS[0], params, Resume([5, 6, 7, 8, 9], "")))
    assert caught.value.param == "resume"


def test_a_resume_past_max_model_len_is_refused(target):
    params = SamplingParams(temperature=0.0, max_tokens=300)
    prompt = [7] * 200
    with pytest.raises(RequestRejected, match=r"200 tokens\) \+ resumed output \(57 tokens\) = "
                       r"257 tokens, over max_model_len=256"):  # fmt: skip
        target.check_request(request_of(prompt, params, Resume([9] * 57, "")))
    with pytest.raises(RequestRejected, match=r"token 1 \(id 9999\) is outside the vocabulary"):
        target.check_request(request_of(prompt, params, Resume([9, 9999], "")))


def test_a_resume_reaching_max_model_len_ends_at_once(target):
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    prompt = [7] * 200
    resume = Resume([9] * 56, target.tokenizer.decode([9] * 56))
    rest = run(target, request_of(prompt, params, resume))
    assert rest.tokens == [] and rest.last.finish_reason == "length"
    assert rest.last.num_output_tokens == 56


def test_a_resumed_token_the_grammar_rejects_is_refused_by_position(origin, target):
    params = SamplingParams(temperature=0.0, max_tokens=10,
                            structured=StructuredOutput("regex", "[0-9]{8}"))  # fmt: skip
    full = run(origin, request_of(PROMPTS[2], params))
    letter = origin.tokenizer.encode("a", add_special_tokens=False)[0]
    bad = full.tokens[:3] + [letter]
    with pytest.raises(RequestRejected, match=rf"resumed output token 3 \(id {letter}\) is not "
                       "allowed by the request's structured-output grammar"):  # fmt: skip
        target.add(request_of(PROMPTS[2], params, Resume(bad, "")))
    assert target.num_request_states == 0 and not target.has_unfinished()


def test_a_resume_ended_before_its_last_token_is_refused(target):
    params = SamplingParams(temperature=0.0, max_tokens=10)
    with pytest.raises(RequestRejected, match=rf"resumed output token 1 \(id {TINY_EOS_ID}\) "
                       r"ends the request \(stop\), but 2 more follow it"):  # fmt: skip
        target.add(request_of(PROMPTS[2], params, Resume([40, TINY_EOS_ID, 41, 42], "")))
    assert target.num_request_states == 0 and not target.has_unfinished()


def test_a_resume_whose_text_does_not_match_its_tokens_is_refused(target):
    tokens = target.tokenizer.encode(" hello world", add_special_tokens=False)
    with pytest.raises(RequestRejected, match=r"differs from the decode of output_token_ids "
                       r"at character 6"):  # fmt: skip
        target.add(request_of(PROMPTS[2], GREEDY, Resume(tokens, " helloXworld")))
    assert target.num_request_states == 0 and not target.has_unfinished()


def test_resume_through_the_in_thread_engine(tiny_llama_dir, origin):
    """The thread transport: a resume continues; one whose text does not match its tokens
    ends its stream with the refusal (raised on the engine thread, delivered to the caller)."""
    from replica.engine import AsyncEngine

    full = run(origin, request_of(PROMPTS[3], SEEDED_TOP_K))

    async def body():
        engine = AsyncEngine(make_engine(tiny_llama_dir, engine_core="thread"))
        try:
            resumed = request_of(PROMPTS[3], SEEDED_TOP_K, full.client_view(5))
            deltas = [d async for d in engine.generate(resumed)]
            wrong = request_of(PROMPTS[3], SEEDED_TOP_K, Resume(full.tokens[:3], "nope"))
            with pytest.raises(RequestRejected, match="differs from the decode"):
                [d async for d in engine.generate(wrong)]
            return Run(deltas)
        finally:
            engine.shutdown()

    rest = asyncio.run(asyncio.wait_for(body(), 120))
    assert full.client_view(5).output_token_ids + rest.tokens == full.tokens
    assert full.client_view(5).output_text + rest.text == full.text
