"""The Runner protocol (replica/runner_protocol.py) is all the engine calls on a runner:
ModelRunner, TensorParallelRunner and the tests' FakeRunner provide it, and an Engine runs on any
of them."""

from __future__ import annotations

import pytest

from replica.config import EngineConfig
from replica.engine import Engine
from replica.parallel import TensorParallelRunner
from replica.request import EngineDeadError, SamplingParams
from replica.runner import ModelRunner
from replica.runner_protocol import Runner, RunnerOutput
from replica.scheduler import SchedulerOutput
from tests.conftest import TINY_VOCAB
from tests.fake_runner import FakeRunner

MEMBERS = {
    "max_model_len", "vocab_size", "num_kv_blocks", "startup_s", "execute", "check_health",
    "shutdown",
}  # fmt: skip


def test_the_protocol_lists_what_the_engine_calls():
    assert {name for name in vars(Runner) if not name.startswith("_")} == MEMBERS


def test_fake_runner_is_a_runner():
    runner = FakeRunner(block_size=4, vocab_size=100, num_kv_blocks=32, max_model_len=64)
    assert isinstance(runner, Runner)
    assert (runner.max_model_len, runner.vocab_size, runner.num_kv_blocks) == (64, 100, 32)
    assert runner.execute(SchedulerOutput()) == RunnerOutput({})
    runner.check_health()
    runner.shutdown()
    with pytest.raises(EngineDeadError):
        runner.check_health()


def test_model_runner_is_a_runner(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=16)
    runner = ModelRunner(config, tiny_llama_dir)
    assert isinstance(runner, Runner)
    assert (runner.max_model_len, runner.vocab_size, runner.num_kv_blocks) == (512, TINY_VOCAB, 16)
    assert runner.execute(SchedulerOutput()) == RunnerOutput({})
    runner.check_health()
    runner.shutdown()


def test_tensor_parallel_runner_has_every_member():
    """An instance needs a group of processes: test_tensor_parallel.py checks one with
    isinstance; here the class."""
    assert all(hasattr(TensorParallelRunner, name) for name in MEMBERS)


def test_engine_runs_on_any_runner(tiny_llama_dir):
    """The engine needs nothing beyond the protocol: a FakeRunner serves a request end to end."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", block_size=4)
    runner = FakeRunner(4, vocab_size=TINY_VOCAB, num_kv_blocks=64, max_model_len=128)
    engine = Engine(config, runner=runner, tokenizer=tokenizer)
    assert (engine.max_model_len, engine.vocab_size, engine.num_kv_blocks) == (128, TINY_VOCAB, 64)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert sum(len(o.new_token_ids) for o in outputs) == 5
    assert outputs[-1].finish_reason == "length"
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        runner.check_health()
