"""A request whose sampled tokens show its client no text yet (a byte-level piece of a
character) gets its next token before any prompt runs (EngineConfig.first_text_priority): the
watch that tells (replica/first_text.py, the front's detokenizer on the same tokenizer), the
scheduler's hold and its refusal of a step join, and the engine end to end, greedy fp32
token-identical to transformers."""

from __future__ import annotations

import random

import pytest

from replica.config import EngineConfig
from replica.engine import Engine
from replica.first_text import MAX_PENDING_TOKENS, FirstTextWatch
from replica.request import RequestStatus, SamplingParams
from replica.scheduler import Scheduler
from replica.tokenizer import LazyTokenizer, load_tokenizer
from tests.helpers import engine_request, scheduler_request
from tests.replica.test_model_parity import hf_greedy
from tests.replica.test_step_join import make_engine


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def emit(watch: FirstTextWatch, request, tokens: list[int]) -> bool:
    """The step gave `request` these tokens: its pending flag after the watch saw them."""
    request.all_token_ids.extend(tokens)
    watch.observe(request, tokens)
    return request.text_pending


def test_a_character_split_over_three_tokens_is_pending_until_its_last(tokenizer):
    pieces = tokenizer.encode("世")
    assert len(pieces) == 3  # the tiny vocabulary has its UTF-8 bytes only
    watch = FirstTextWatch(tokenizer)
    request = scheduler_request("a", tokenizer.encode("hello"), greedy(8))
    assert emit(watch, request, pieces[:1]) and len(watch) == 1
    assert emit(watch, request, pieces[1:2])
    assert not emit(watch, request, pieces[2:]) and len(watch) == 0
    # later tokens are not watched, whatever they are
    assert not emit(watch, request, pieces[:1])


def test_tokens_that_complete_a_character_in_one_step_are_not_pending(tokenizer):
    watch = FirstTextWatch(tokenizer)
    request = scheduler_request("a", tokenizer.encode("hi"), greedy(8))
    assert not emit(watch, request, tokenizer.encode("世"))  # a step with accepted drafts
    ascii_request = scheduler_request("b", tokenizer.encode("hi"), greedy(8))
    assert not emit(watch, ascii_request, tokenizer.encode(" there")[:1])
    assert len(watch) == 0


def test_a_request_is_watched_for_its_first_tokens_only(tokenizer):
    lead = tokenizer.encode("世")[0]  # a lead byte that no token completes here
    watch = FirstTextWatch(tokenizer)
    request = scheduler_request("a", tokenizer.encode("hi"), greedy(16))
    pending = [emit(watch, request, [lead]) for _ in range(MAX_PENDING_TOKENS)]
    assert pending == [True] * (MAX_PENDING_TOKENS - 1) + [False]
    assert len(watch) == 0


def test_a_finished_resumed_or_forgotten_request_is_not_pending(tokenizer):
    from replica.request import EngineRequest, Request, Resume

    lead = tokenizer.encode("世")[0]
    watch = FirstTextWatch(tokenizer)
    finished = scheduler_request("a", tokenizer.encode("hi"), greedy(1))
    finished.status = RequestStatus.FINISHED_LENGTH
    assert not emit(watch, finished, [lead])
    resumed = Request(
        EngineRequest(tokenizer.encode("hi"), greedy(8), "r", resume=Resume([lead], ""))
    )
    assert not emit(watch, resumed, [lead])  # its client's text is the lost replica's business
    forgotten = scheduler_request("f", tokenizer.encode("hi"), greedy(8))
    assert emit(watch, forgotten, [lead])
    watch.forget("f")
    assert len(watch) == 0


def test_nothing_is_watched_before_a_lazy_tokenizer_is_loaded(tiny_tokenizer_dir, tokenizer):
    lazy = LazyTokenizer(tiny_tokenizer_dir)
    watch = FirstTextWatch(lazy)
    request = scheduler_request("a", tokenizer.encode("hi"), greedy(8))
    lead = tokenizer.encode("世")[0]
    assert not watch.ready and not emit(watch, request, [lead])
    lazy.get()
    other = scheduler_request("b", tokenizer.encode("hi"), greedy(8))
    assert watch.ready and emit(watch, other, [lead])


# -- the scheduler's hold ------------------------------------------------------------------


def decoding(sched: Scheduler, rid: str, prompt: list[int]):
    """A request that ran its prompt and sampled one token (now due for its next)."""
    request = scheduler_request(rid, prompt, greedy(8))
    sched.add_request(request)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == [rid]
    sched.update_from_output(out, {rid: 7})
    return request


def make_scheduler(**fields) -> Scheduler:
    fields = {"block_size": 4, "num_speculative_tokens": 0, "first_text_priority": True, **fields}
    return Scheduler(EngineConfig(**fields), 64, 512)


@pytest.mark.parametrize("priority", [True, False])
def test_prompts_wait_one_step_for_a_first_text(priority):
    sched = make_scheduler(first_text_priority=priority)
    a = decoding(sched, "a", list(range(10, 16)))
    a.text_pending = True
    sched.add_request(scheduler_request("b", list(range(40, 48)), greedy(4)))
    out = sched.schedule()
    ran = [(s.request_id, s.num_tokens) for s in out.scheduled]
    if not priority:
        assert ran == [("a", 1), ("b", 8)] and sched.num_first_text_holds_total == 0
        return
    assert ran == [("a", 1)] and out.decodes_only
    assert sched.stats().num_first_text_holds_total == 1
    sched.update_from_output(out, {"a": 8})
    a.text_pending = False  # the engine's watch: that token brought the text
    out = sched.schedule()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 8)]
    assert sched.num_first_text_holds_total == 1


def test_a_running_prompt_chunk_waits_too_but_never_two_steps_in_a_row():
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=0)
    a = decoding(sched, "a", list(range(10, 14)))
    sched.add_request(scheduler_request("c", list(range(100, 140)), greedy(4)))
    out = sched.schedule()  # a decodes, c's first chunk (15 tokens) runs
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("c", 15)]
    sched.update_from_output(out, {"a": 8})
    a.text_pending = True
    out = sched.schedule()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1)]
    assert sched.num_first_text_holds_total == 1
    sched.update_from_output(out, {"a": 9})
    out = sched.schedule()  # a still shows no text, but c waited one step: it runs now
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("c", 15)]
    sched.update_from_output(out, {"a": 9})
    out = sched.schedule()  # and the step after may hold again
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1)]
    assert sched.num_first_text_holds_total == 2
    sched2 = make_scheduler()
    lone = decoding(sched2, "a", list(range(10, 14)))
    lone.text_pending = True
    sched2.schedule()
    assert sched2.num_first_text_holds_total == 0  # no prompt waited: nothing held


def test_no_hold_or_join_refusal_with_more_than_one_prompt_waiting():
    sched = make_scheduler()
    a = decoding(sched, "a", list(range(10, 16)))
    a.text_pending = True
    for rid, base in (("b", 40), ("c", 60)):
        sched.add_request(scheduler_request(rid, list(range(base, base + 8)), greedy(4)))
    out = sched.schedule()  # the engine is behind its arrivals: a held step costs them all
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"]
    assert sched.num_first_text_holds_total == 0
    sched.update_from_output(out, {"a": 8, "b": 1, "c": 2})
    step = sched.schedule()
    assert step.decodes_only
    for rid, base in (("d", 80), ("e", 100)):
        sched.add_request(scheduler_request(rid, list(range(base, base + 8)), greedy(4)))
    joined = sched.schedule_join(step)
    assert joined is not None and [s.request_id for s in joined.scheduled] == ["d", "e"]


def test_no_prompt_joins_a_step_that_brings_a_first_text():
    sched = make_scheduler()
    a = decoding(sched, "a", list(range(10, 16)))
    a.text_pending = True
    step = sched.schedule()
    assert step.decodes_only
    sched.add_request(scheduler_request("b", list(range(40, 48)), greedy(4)))
    assert sched.schedule_join(step) is None
    a.text_pending = False
    joined = sched.schedule_join(step)
    assert joined is not None and [s.request_id for s in joined.scheduled] == ["b"]


# -- the engine, end to end ----------------------------------------------------------------


def fragment_first_prompt(engine: Engine) -> list[int]:
    """A prompt whose greedy first token shows no text alone (a seeded search)."""
    tokenizer = engine.tokenizer
    rng = random.Random(0)
    for k in range(200):
        prompt = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(4, 12))]
        engine.add_request(f"probe{k}", prompt, greedy(1))
        while engine.has_unfinished():
            for out in engine.step():
                if "\ufffd" in tokenizer.decode(out.new_token_ids):
                    return prompt
    raise AssertionError("no prompt of 200 starts with a piece of a character")


@pytest.mark.parametrize("priority", [True, False])
def test_engine_runs_a_first_texts_token_before_a_prompt(tiny_llama_dir, priority):
    engine = make_engine(tiny_llama_dir, first_text_priority=priority)
    assert not EngineConfig().first_text_priority  # opt-in
    first = fragment_first_prompt(engine)
    other = [5, 9, 33, 101, 77, 64, 12]
    outputs: dict[str, list[int]] = {}
    steps: list[list[str]] = []
    engine.step_listeners.append(
        lambda e, so, outs, t: steps.append([s.request_id for s in so.scheduled])
    )

    def run() -> None:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    engine.add(engine_request(first, greedy(6), request_id="a"))
    run()
    assert engine.scheduler.requests["a"].text_pending is priority
    engine.add(engine_request(other, greedy(4), request_id="b"))
    added = len(steps)
    run()
    assert steps[-1] == (["a"] if priority else ["a", "b"])
    while engine.has_unfinished():
        run()
    # b's prompt waited while a's tokens showed no text (one step or more: the token after a
    # piece can be another piece), then ran with a's decode
    held = next(i for i, ran in enumerate(steps) if "b" in ran) - added
    assert engine.stats().num_first_text_holds_total == held
    assert (held >= 1) is priority
    assert len(engine.first_text or ()) == 0  # nothing left watched
    assert outputs["a"] == hf_greedy(tiny_llama_dir, tuple(first), 6, False)
    assert outputs["b"] == hf_greedy(tiny_llama_dir, tuple(other), 4, False)


def test_an_engine_core_watches_once_its_tokenizer_is_loaded(tiny_llama_dir):
    engine = Engine(
        EngineConfig(
            model=str(tiny_llama_dir),
            device="cpu",
            block_size=4,
            num_kv_blocks=64,
            first_text_priority=True,
        ),
        detokenize=False,
    )
    assert not engine.first_text.ready  # loaded at the core's first idle heartbeat
    engine.structured.prepare()  # what that heartbeat runs (core_process.py)
    assert engine.first_text.ready
