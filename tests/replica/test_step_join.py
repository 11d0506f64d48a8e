"""Prompts that join a step of decodes under way (EngineConfig.step_join): the scheduler's
admission into a running step, the runner's catch-up through the layers passed, and the core
process reading requests mid-step while other commands wait for the step's end. Outputs are
greedy fp32 token-identical to transformers whatever the layer they join at."""

from __future__ import annotations

import multiprocessing

import pytest

from replica.config import EngineConfig
from replica.engine import Engine
from replica.request import SamplingParams
from tests.helpers import engine_request
from tests.replica.test_model_parity import hf_greedy, mixed_prompts


def greedy(n: int, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **fields)


def make_engine(model_dir, **fields) -> Engine:
    fields = {"device": "cpu", "block_size": 4, "num_kv_blocks": 256,
              "num_speculative_tokens": 0, **fields}  # fmt: skip
    return Engine(EngineConfig(model=str(model_dir), **fields))


class Arrivals:
    """The engine's poll_arrivals for one step: the requests are added when the runner asks
    before layer `layer` (the core process reads them off its pipe there)."""

    def __init__(self, engine: Engine, layer: int, requests) -> None:
        self.engine, self.layer, self.requests, self.calls = engine, layer, requests, 0

    def __call__(self) -> bool:
        self.calls += 1
        if self.calls - 1 != self.layer:
            return False
        for request in self.requests:
            self.engine.add(request)
        return True


def run(engine: Engine, outputs: dict, arrivals=None) -> list[str]:
    """One step (with `arrivals` as its poll, or none arriving); the ids that got tokens."""
    engine.poll_arrivals = arrivals if arrivals is not None else (lambda: False)
    stepped = engine.step()
    for out in stepped:
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [out.request_id for out in stepped if out.new_token_ids]


def finish(engine: Engine, outputs: dict) -> None:
    while engine.has_unfinished():
        run(engine, outputs)


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, tiny_llama_dir, tiny_qwen2_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[request.param]


def test_prompts_join_a_decode_step_at_any_layer_and_match_transformers(model_dir, cpu_isa_level):
    """Two requests decode; two prompts arrive before layer k of a decode step: they run the
    k layers passed on their own, the rest with the decodes, and their first tokens come with
    that step's. Every request's output equals transformers' greedy continuation, at every
    instruction-set level this CPU runs."""
    prompts = mixed_prompts(3, [7, 12, 5, 30])
    lengths = [12, 10, 8, 9]
    engine = make_engine(model_dir)
    num_layers = engine.runner.model.num_layers
    expected = [hf_greedy(model_dir, tuple(p), n, False) for p, n in zip(prompts, lengths)]
    for layer in range(num_layers):
        engine = make_engine(model_dir)
        outputs: dict[str, list[int]] = {}
        for rid, prompt, n in zip("ab", prompts, lengths):
            engine.add(engine_request(prompt, greedy(n), request_id=rid))
        run(engine, outputs)  # both prompts
        run(engine, outputs)  # a decode step, nothing arrives
        arriving = [engine_request(p, greedy(n), request_id=rid)
                    for rid, p, n in zip("cd", prompts[2:], lengths[2:])]  # fmt: skip
        arrivals = Arrivals(engine, layer, arriving)
        got = run(engine, outputs, arrivals)
        assert engine.last_join == layer and arrivals.calls == layer + 1
        assert sorted(got) == ["a", "b", "c", "d"]
        assert engine.scheduler.num_joined_total == 2
        finish(engine, outputs)
        assert [outputs[rid] for rid in "abcd"] == expected, f"joined at layer {layer}"


def test_a_long_prompt_joins_as_a_chunk_within_the_steps_budget(tiny_llama_dir):
    """The budget left by the step's decodes caps the joining chunk; the prompt's rest runs in
    the next steps and its output still matches."""
    prompts = mixed_prompts(4, [9, 40])
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=16, long_prefill_token_threshold=0)
    outputs: dict[str, list[int]] = {}
    engine.add(engine_request(prompts[0], greedy(8), request_id="a"))
    run(engine, outputs)
    run(engine, outputs)
    joining = engine_request(prompts[1], greedy(6), request_id="long")
    got = run(engine, outputs, Arrivals(engine, 1, [joining]))
    assert engine.last_join == 1 and got == ["a"]  # a chunk of 15: no token yet
    assert engine.scheduler.requests["long"].num_computed_tokens == 15
    finish(engine, outputs)
    assert outputs["a"] == hf_greedy(tiny_llama_dir, tuple(prompts[0]), 8, False)
    assert outputs["long"] == hf_greedy(tiny_llama_dir, tuple(prompts[1]), 6, False)


def test_no_join_into_a_step_with_a_prompt_or_when_it_is_off(tiny_llama_dir):
    """A step that runs a prompt chunk is not joined (the arrival would delay that prompt's
    first token): the runner never asks. With step_join off no step is."""
    prompts = mixed_prompts(5, [6, 8, 5])
    engine = make_engine(tiny_llama_dir)
    outputs: dict[str, list[int]] = {}
    engine.add(engine_request(prompts[0], greedy(6), request_id="a"))
    arrivals = Arrivals(engine, 0, [engine_request(prompts[2], greedy(4), request_id="c")])
    run(engine, outputs, arrivals)  # a's prompt: no question asked
    assert arrivals.calls == 0 and engine.last_join is None
    engine.add(engine_request(prompts[1], greedy(6), request_id="b"))
    run(engine, outputs, arrivals)  # a decodes, b's prompt runs: still none
    assert arrivals.calls == 0

    off = make_engine(tiny_llama_dir, step_join=False)
    off.add(engine_request(prompts[0], greedy(6), request_id="a"))
    run(off, outputs)
    arrivals = Arrivals(off, 0, [engine_request(prompts[2], greedy(4), request_id="c")])
    run(off, outputs, arrivals)
    assert arrivals.calls == 0 and off.last_join is None


def test_join_refuses_what_it_cannot_lay_out_and_never_preempts(tiny_llama_dir):
    """At the queue's head a request wanting prompt logprobs stops the join (it keeps its place
    and is admitted at the next step); a prompt the KV pool cannot hold stays waiting, the
    decodes untouched (a preemption mid-step would free blocks the step is writing)."""
    prompts = mixed_prompts(6, [6, 7, 5, 30])
    engine = make_engine(tiny_llama_dir)
    outputs: dict[str, list[int]] = {}
    engine.add(engine_request(prompts[0], greedy(8), request_id="a"))
    run(engine, outputs)
    arriving = [
        engine_request(prompts[1], greedy(3, prompt_logprobs=1), request_id="logprobs"),
        engine_request(prompts[2], greedy(3), request_id="plain"),
    ]
    got = run(engine, outputs, Arrivals(engine, 1, arriving))
    assert got == ["a"] and engine.last_join is None
    assert [r.request_id for r in engine.scheduler.waiting] == ["logprobs", "plain"]
    assert sorted(run(engine, outputs)) == ["a", "logprobs", "plain"]  # the next step's

    small = make_engine(tiny_llama_dir, num_kv_blocks=8, max_model_len=32)
    small.add(engine_request(prompts[0], greedy(8), request_id="a"))
    run(small, outputs)
    big = engine_request(prompts[3][:26], greedy(2), request_id="big")  # 7 blocks: 2 free
    got = run(small, outputs, Arrivals(small, 1, [big]))
    assert got == ["a"] and small.last_join is None
    assert small.scheduler.num_preemptions_total == 0
    assert [r.request_id for r in small.scheduler.waiting] == ["big"]


def test_the_core_takes_requests_mid_step_and_holds_other_commands_for_its_end(tiny_llama_dir):
    """EngineCore reads its pipe before each layer of a decode step: a plain Add joins; the
    first other command (an Abort) waits for the step's end and the pipe is read no further,
    so commands keep their order and nothing frees blocks the step is writing."""
    from replica.engine.core_process import EngineCore
    from replica.engine.wire import Abort, Add, core_codec

    prompts = mixed_prompts(7, [6, 5, 8])
    engine = make_engine(tiny_llama_dir)
    front, back = multiprocessing.Pipe()
    try:
        core = EngineCore(engine, back, kv_events=False)
        outputs: dict[str, list[int]] = {}
        engine.add(engine_request(prompts[0], greedy(8), request_id="a"))
        engine.poll_arrivals = lambda: False
        engine.step()
        engine.poll_arrivals = core._arrivals
        codec = core_codec()
        for message in (
            Add(engine_request(prompts[1], greedy(4), request_id="b")),
            Abort("a"),
            Add(engine_request(prompts[2], greedy(4), request_id="c")),
        ):
            front.send_bytes(codec.encode(message))
        stepped = {out.request_id for out in engine.step() if out.new_token_ids}
        assert stepped == {"a", "b"} and engine.last_join == 0
        # the Abort waits; the Add behind it is left on the pipe for the loop to read
        assert [type(m).__name__ for m in core._deferred] == ["Abort"] and back.poll(0)
        assert core.handle_deferred() and not core._deferred
        assert "a" not in engine.scheduler.requests
        assert core._handle(codec.decode(back.recv_bytes()))
        assert [r.request_id for r in engine.scheduler.waiting] == ["c"]
        engine.poll_arrivals = lambda: False
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert outputs["c"] == hf_greedy(tiny_llama_dir, tuple(prompts[2]), 4, False)
    finally:
        front.close()
        back.close()


def test_a_prompt_joins_a_step_that_verifies_drafts(tiny_llama_dir):
    """With prompt-lookup drafts on, a decode step may verify a draft: the joining prompt's
    sampled row goes between the step's sampled rows and its draft rows (the runner's logits
    layout), and every output still matches transformers."""
    prompt = [5, 6, 7, 8, 9] * 6
    other = mixed_prompts(8, [11])[0]
    engine = make_engine(tiny_llama_dir, num_speculative_tokens=4)
    schedules = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: schedules.append(schedule()) or schedules[-1]

    class WhenDrafted(Arrivals):
        def __call__(self) -> bool:  # only into a step that runs a draft
            return any(s.draft for s in schedules[-1].scheduled) and super().__call__()

    outputs: dict[str, list[int]] = {}
    engine.add(engine_request(prompt, greedy(24), request_id="a"))
    run(engine, outputs)
    arrivals = WhenDrafted(engine, 1, [engine_request(other, greedy(6), request_id="b")])
    while engine.last_join is None and engine.has_unfinished():
        arrivals.calls = 0
        got = run(engine, outputs, arrivals)
    assert engine.last_join == 1 and "b" in got
    finish(engine, outputs)
    assert engine.scheduler.proposer.stats.num_accepted_tokens > 0
    assert outputs["a"] == hf_greedy(tiny_llama_dir, tuple(prompt), 24, False)
    assert outputs["b"] == hf_greedy(tiny_llama_dir, tuple(other), 6, False)


def test_joined_prompts_are_counted_in_the_metrics(tiny_llama_dir):
    from replica.metrics import EngineMetrics

    prompts = mixed_prompts(9, [6, 5, 7])
    engine = make_engine(tiny_llama_dir)
    metrics = EngineMetrics(engine, "m", "r0")
    outputs: dict[str, list[int]] = {}
    engine.add(engine_request(prompts[0], greedy(6), request_id="a"))
    run(engine, outputs)
    arriving = [engine_request(p, greedy(3), request_id=rid) for rid, p in zip("bc", prompts[1:])]
    run(engine, outputs, Arrivals(engine, 1, arriving))
    finish(engine, outputs)
    assert engine.stats().num_joined_total == 2
    text = metrics.exposition().decode()
    assert 'stepserve:step_joined_requests_total{model_name="m",replica="r0"} 2.0' in text
