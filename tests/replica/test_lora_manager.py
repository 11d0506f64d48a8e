"""The replica's adapters: an LRU of max_cpu_loras loaded on demand (a request waits while
its adapter loads, never the others; a request pins its adapter until it ends), at most
max_loras adapters in one step (a request that would exceed it is skipped, not failed), the
engine, engine-core and wire API, and a clear LoRAError (HTTP 400, param "model") for every
adapter we cannot serve."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file, save_file

from replica.config import EngineConfig
from replica.contracts import PreemptionRate, RoutingStats
from replica.engine import LLM, Engine, wire
from replica.engine.core_client import ProcessEngine
from replica.errors import LoRAError
from replica.request import EngineRequest, LoRARequest, Request, SamplingParams
from replica.scheduler import Scheduler
from replica.tiny_lora import build_tiny_adapter
from tests.fake_runner import FakeRunner
from tests.replica.lora_helpers import edit_adapter, make_adapters, peft_greedy
from tests.replica.test_lora_parity import LORA_FIELDS
from tests.replica.test_model_parity import greedy_params, mixed_prompts


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    return make_adapters(tiny_llama_dir, tmp_path_factory.mktemp("adapters"))


def lora_request(rid: str, lora: LoRARequest | None, prompt=(5, 6, 7, 8, 9), max_tokens=4):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest(list(prompt), params, rid, lora=lora)


def run_to_end(engine: Engine, limit: int = 1000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("the engine did not finish")


# -- max_loras in the scheduler ------------------------------------------------------------------
def scheduler_with(max_loras: int, **fields) -> Scheduler:
    config = EngineConfig(
        model="unused", block_size=4, enable_lora=True, max_loras=max_loras, **fields
    )
    return Scheduler(config, 256, 4096)


def test_a_request_beyond_max_loras_waits_its_turn_and_others_pass_it():
    scheduler = scheduler_with(2)
    runner = FakeRunner(block_size=4)
    a, b, c = (LoRARequest(n, f"/adapters/{n}") for n in "abc")
    order = [("r0", a), ("r1", b), ("r2", c), ("r3", a), ("r4", None)]
    for rid, lora in order:
        scheduler.add_request(Request(lora_request(rid, lora, max_tokens=3), frozenset()))
    first = scheduler.schedule()
    # c would be a third adapter: skipped, while a's second request and the base one run
    assert [s.request_id for s in first.scheduled] == ["r0", "r1", "r3", "r4"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    seen_together = []
    so = first
    while scheduler.has_unfinished():
        names = {s.request.lora.name for s in so.scheduled if s.request.lora is not None}
        assert len(names) <= 2
        seen_together.append(names)
        result = runner.execute(so)
        scheduler.update_from_output(so, result.sampled)
        so = scheduler.schedule()
    assert {"c"} in seen_together  # it ran once a and b had finished


def test_preempted_requests_obey_max_loras_when_they_return():
    scheduler = scheduler_with(1)
    a, b = LoRARequest("a", "/a"), LoRARequest("b", "/b")
    scheduler.add_request(Request(lora_request("ra", a), frozenset()))
    so = scheduler.schedule()
    scheduler._preempt_running(scheduler.running[0], so)  # ra back in the queue
    scheduler.add_request(Request(lora_request("rb", b), frozenset()))
    scheduler.waiting.rotate(1)  # rb first in line: it takes the one adapter seat
    so = scheduler.schedule()
    assert [s.request_id for s in so.scheduled] == ["rb"]
    assert [r.request_id for r in scheduler.waiting] == ["ra"]


def test_a_request_whose_adapter_is_loading_is_not_scheduled():
    scheduler = scheduler_with(4)
    loaded: set[str] = set()
    scheduler.lora_ready = lambda lora: lora.name in loaded
    scheduler.add_request(Request(lora_request("r0", LoRARequest("x", "/x")), frozenset()))
    scheduler.add_request(Request(lora_request("r1", None), frozenset()))
    assert [s.request_id for s in scheduler.schedule().scheduled] == ["r1"]
    loaded.add("x")
    assert [s.request_id for s in scheduler.schedule().scheduled] == ["r0"]


# -- the LRU ----------------------------------------------------------------------------------
def test_lru_evicts_the_least_recently_used_and_reloads_on_demand(tiny_llama_dir, adapters):
    a, b, c = adapters["attn4"], adapters["all8"], adapters["qv2-rs"]
    prompt = mixed_prompts(4, [11])[0]
    fields = LORA_FIELDS | {"max_loras": 1, "max_cpu_loras": 2}
    with LLM(tiny_llama_dir, **fields) as llm:
        manager = llm.engine.loras
        held = []
        for lora in (a, b, a, c, b, a):
            (out,) = llm.generate([prompt], greedy_params(5), lora=lora)
            assert out.output_token_ids == peft_greedy(tiny_llama_dir, lora.path, tuple(prompt), 5)
            held.append(llm.list_loras())
        assert held == [
            ["attn4"],
            ["attn4", "all8"],
            ["all8", "attn4"],  # a used again: b is now the least recently used
            ["attn4", "qv2-rs"],  # c evicted b
            ["qv2-rs", "all8"],  # b reloaded, evicting a
            ["all8", "attn4"],
        ]
        assert (manager.num_loads, manager.num_evictions) == (5, 3)


def test_a_pinned_adapter_is_not_evicted_and_the_next_one_waits(tiny_llama_dir, adapters):
    a, b = adapters["attn4"], adapters["all8"]
    config = EngineConfig(model=str(tiny_llama_dir), **LORA_FIELDS | {"max_loras": 1})
    engine = Engine(config)  # one adapter slot
    try:
        engine.add(lora_request("ra", a, max_tokens=6))
        engine.add(lora_request("rb", b, max_tokens=6))
        finished_order = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished_order.append(out.request_id)
            # while ra runs, its adapter holds the slot and rb waits for it
            if "ra" not in finished_order:
                assert engine.list_loras() in ([], ["attn4"])
        assert finished_order == ["ra", "rb"]
        assert engine.list_loras() == ["all8"]
        assert engine.loras.num_evictions == 1
    finally:
        engine.shutdown()


def test_remove_lora_waits_for_the_requests_that_use_it(tiny_llama_dir, adapters):
    a = adapters["attn4"]
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), **LORA_FIELDS))
    try:
        info = engine.add_lora(a.name, a.path)
        assert info["name"] == "attn4" and info["rank"] == 4 and info["load_s"] > 0
        assert info["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
        engine.add(lora_request("r", a, max_tokens=5))
        (first,) = engine.step()
        assert engine.remove_lora("attn4") is True
        assert engine.list_loras() == ["attn4"]  # pinned by r
        tokens = run_to_end(engine)
        assert len(first.new_token_ids + tokens["r"]) == 5
        assert engine.list_loras() == []
        assert engine.remove_lora("attn4") is False
    finally:
        engine.shutdown()


def test_a_failed_load_ends_only_its_requests(tiny_llama_dir, adapters, tmp_path):
    missing = LoRARequest("ghost", str(tmp_path / "nowhere"))
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), **LORA_FIELDS))
    try:
        engine.add(lora_request("bad", missing))
        engine.add(lora_request("good", adapters["attn4"]))
        engine.add(lora_request("base", None))
        errors = []
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            errors += engine.take_request_errors()
        assert [rid for rid, _ in errors] == ["bad"]
        error = errors[0][1]
        assert isinstance(error, LoRAError) and error.param == "model"
        assert "does not exist" in str(error) and "ghost" in str(error)
        assert sorted(tokens) == ["base", "good"] and all(len(t) == 4 for t in tokens.values())
        assert engine.num_request_states == 0 and engine.list_loras() == ["attn4"]
    finally:
        engine.shutdown()


def test_the_offline_llm_raises_a_failed_adapter_load(tiny_llama_dir, tmp_path):
    with LLM(tiny_llama_dir, **LORA_FIELDS) as llm:
        with pytest.raises(LoRAError, match="does not exist"):
            llm.generate([[5, 6, 7]], lora=LoRARequest("ghost", str(tmp_path / "nowhere")))
        assert llm.engine.num_request_states == 0


def test_lora_modules_are_loaded_at_start(tiny_llama_dir, adapters):
    modules = [{"name": n, "path": r.path} for n, r in adapters.items()]
    fields = LORA_FIELDS | {"enable_lora": False, "lora_modules": modules}
    with LLM(tiny_llama_dir, **fields) as llm:
        assert llm.list_loras() == list(adapters)
        assert llm.engine.stats().loras == tuple(adapters)


# -- LoRAError: every adapter we cannot serve ---------------------------------------------------
def _error(engine: Engine, name: str, path) -> str:
    with pytest.raises(LoRAError) as info:
        engine.add_lora(name, str(path))
    assert info.value.param == "model"
    return str(info.value)


@pytest.fixture(scope="module")
def lora_engine(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), **LORA_FIELDS))
    yield engine
    engine.shutdown()


def test_errors_name_what_is_wrong(lora_engine, adapters, tmp_path, tiny_llama_dir):
    source = adapters["attn4"].path
    assert "does not exist" in _error(lora_engine, "x", tmp_path / "none")
    (tmp_path / "empty").mkdir()
    assert "no adapter_config.json" in _error(lora_engine, "x", tmp_path / "empty")
    no_weights = edit_adapter(source, tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors or adapter_model.bin" in _error(
        lora_engine, "x", no_weights
    )
    big = build_tiny_adapter(tiny_llama_dir, tmp_path / "rank16", rank=16)
    message = _error(lora_engine, "big", big)
    assert "rank 16 exceeds max_lora_rank=8" in message and "'big'" in message
    lacking = edit_adapter(source, tmp_path / "lacking", target_modules=["q_proj", "c_attn"])
    message = _error(lora_engine, "x", lacking)
    assert "['c_attn']" in message and "'q_proj', 'k_proj', 'v_proj', 'o_proj'" in message
    experts = edit_adapter(source, tmp_path / "experts", target_modules=["experts.gate_proj"])
    assert "mixture-of-experts" in _error(lora_engine, "x", experts)
    for field, value in (
        ("use_dora", True),
        ("modules_to_save", ["lm_head"]),
        ("rank_pattern", {"q_proj": 2}),
    ):
        edited = edit_adapter(source, tmp_path / field, **{field: value})
        assert f"{field}={value!r} is not supported" in _error(lora_engine, "x", edited)
    biased = edit_adapter(source, tmp_path / "bias", bias="all")
    assert "bias='all' is not supported" in _error(lora_engine, "x", biased)
    assert lora_engine.list_loras() == []


def test_errors_for_tensors_the_model_cannot_take(lora_engine, adapters, tmp_path):
    source = adapters["attn4"].path

    def with_tensors(name: str, edit) -> str:
        out = edit_adapter(source, tmp_path / name)
        tensors = load_file(out / "adapter_model.safetensors")
        edit(tensors)
        save_file(tensors, out / "adapter_model.safetensors")
        return str(out)

    head = with_tensors(
        "head", lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)})
    )
    assert "lm_head.lora_A.weight" in _error(lora_engine, "x", head)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"

    def narrow(t):
        t[key] = t[key][:-1]

    message = _error(lora_engine, "x", with_tensors("narrow", narrow))
    assert "layers.0.self_attn.q_proj" in message and "needs" in message

    def far_layer(t):
        for half in "AB":
            src = f"base_model.model.model.layers.0.self_attn.q_proj.lora_{half}.weight"
            t[src.replace("layers.0", "layers.99")] = t[src].clone()

    assert "layers.99.self_attn.q_proj, a layer" in _error(
        lora_engine, "x", with_tensors("far", far_layer)
    )


def test_a_lora_request_on_a_replica_without_lora_is_refused(tiny_llama_dir, adapters):
    fields = {k: v for k, v in LORA_FIELDS.items() if k != "enable_lora"}
    with LLM(tiny_llama_dir, **fields) as llm:
        with pytest.raises(LoRAError, match="LoRA is off on this replica") as info:
            llm.generate([[5, 6]], lora=adapters["attn4"])
        assert info.value.param == "model"
        assert llm.engine.num_request_states == 0
        with pytest.raises(LoRAError, match="LoRA is off"):
            llm.add_lora("attn4", adapters["attn4"].path)


# -- across the engine core's process ---------------------------------------------------------
def test_wire_carries_lora_calls_and_held_adapters():
    call = wire.Call(1, wire.CoreOp.LORA_ADD, ["name", "/path"])
    assert wire.core_codec().decode(wire.front_codec().encode(call)) == call
    stats = Scheduler(EngineConfig(model="unused"), 16, 64).stats()
    stats.loras = ("a", "b")
    idle = wire.Idle(stats, 3, 0)
    back = wire.front_codec().decode(wire.core_codec().encode(idle))
    assert back.stats.loras == ("a", "b")
    routing = RoutingStats.of_scheduler(
        "r", 1.0, back.stats, EngineConfig(model="unused"), PreemptionRate(5.0), 16, 3
    )
    assert routing.loras == ("a", "b")


def test_lora_calls_cross_the_engine_core_process(tiny_llama_dir, adapters, tmp_path):
    a = adapters["attn4"]
    config = EngineConfig(model=str(tiny_llama_dir), **LORA_FIELDS, max_model_len=256)

    async def body():
        engine = ProcessEngine(config)
        try:
            info = await asyncio.wrap_future(engine.call(wire.CoreOp.LORA_ADD, [a.name, a.path]))
            assert info["name"] == "attn4" and info["rank"] == 4
            assert await asyncio.wrap_future(engine.call(wire.CoreOp.LORA_LIST)) == ["attn4"]
            with pytest.raises(LoRAError, match="does not exist"):
                await asyncio.wrap_future(
                    engine.call(wire.CoreOp.LORA_ADD, ["x", str(tmp_path / "none")])
                )
            # a request whose adapter cannot load ends with its LoRAError
            with pytest.raises(LoRAError, match="does not exist"):
                async for _ in engine.generate(
                    lora_request("bad", LoRARequest("ghost", str(tmp_path / "none")))
                ):
                    pass
            prompt = mixed_prompts(4, [9])[0]
            merged = None
            async for out in engine.generate(lora_request("ok", a, prompt, 5)):
                merged = out if merged is None else merged.merge(out)
            assert merged.new_token_ids == peft_greedy(tiny_llama_dir, a.path, tuple(prompt), 5)
            assert await asyncio.wrap_future(engine.call(wire.CoreOp.LORA_REMOVE, "attn4"))
            assert await asyncio.wrap_future(engine.call(wire.CoreOp.LORA_LIST)) == []
        finally:
            engine.shutdown()

    asyncio.run(asyncio.wait_for(body(), 120))


def test_bin_weights_and_a_regex_target_load_as_safetensors_do(tiny_llama_dir, adapters, tmp_path):
    """PEFT's older adapter_model.bin (torch.load, weights only) and target_modules given as a
    regex string serve the same adapter."""
    source = adapters["all8"]
    binary = edit_adapter(
        source.path, tmp_path / "bin", target_modules=r".*\.(q|k|v|o|gate|up|down)_proj"
    )
    tensors = load_file(binary / "adapter_model.safetensors")
    (binary / "adapter_model.safetensors").unlink()
    torch.save(tensors, binary / "adapter_model.bin")
    prompt = mixed_prompts(6, [10])[0]
    with LLM(tiny_llama_dir, **LORA_FIELDS) as llm:
        info = llm.add_lora("bin", str(binary))
        assert info["rank"] == 8 and len(info["target_modules"]) == 7
        outs = llm.generate(
            [prompt, prompt], greedy_params(6), lora=[source, LoRARequest("bin", str(binary))]
        )
    assert outs[0].output_token_ids == outs[1].output_token_ids
    assert outs[0].output_token_ids == peft_greedy(tiny_llama_dir, source.path, tuple(prompt), 6)


def test_an_adapter_loaded_again_from_another_path_replaces_the_old_one(lora_engine, adapters):
    """The name unloaded and loaded again from another path (the ingress's registry): a
    replica still holding the old files drops them for the new ones while no request uses
    them, and refuses (naming both paths) while one does."""
    a, b = adapters["attn4"], adapters["all8"]
    lora_engine.add_lora("same-name", a.path)
    try:
        lora_engine.add(lora_request("old", LoRARequest("same-name", a.path), max_tokens=50))
        with pytest.raises(LoRAError, match="is loaded from .* in use by 1") as info:
            lora_engine.add(lora_request("r", LoRARequest("same-name", b.path)))
        assert info.value.param == "model"
        run_to_end(lora_engine)
        lora_engine.add(lora_request("new", LoRARequest("same-name", b.path)))
        replaced = run_to_end(lora_engine)["new"]
        lora_engine.add(lora_request("ref", b))
        assert replaced == run_to_end(lora_engine)["ref"]
        assert lora_engine.list_loras().count("same-name") == 1
    finally:
        assert lora_engine.remove_lora("same-name")
