"""The ingress's `model` resolution (no Ray): a served model's name, an adapter's (static from
the config, or loaded at run time into the registry every ingress replica reads), the first
model when none is named, 404 model_not_found naming what is served otherwise; /v1/models'
cards; an unload seen at once by the ingress that made it and by the others after a refresh."""

from __future__ import annotations

import asyncio
import types

import pytest

import router.lora_registry
from replica.api import LoRARequest
from replica.config import EngineConfig, LoRAModule
from router.errors import HTTPError
from router.ingress_core import IngressCore
from router.lora_registry import Adapter, LoRARegistry
from router.policy import RoutingConfig
from router.settings import IngressSettings, ModelSettings


def _handle(max_model_len: int):
    async def model_info():
        return {"max_model_len": max_model_len, "vocab_size": 512}

    handle = types.SimpleNamespace(model_info=types.SimpleNamespace(remote=model_info))
    handle.options = lambda **_: handle
    return handle


@pytest.fixture
def settings(tiny_llama_dir, tiny_qwen2_dir) -> IngressSettings:
    llama = ModelSettings(
        name="llama",
        model_dir=str(tiny_llama_dir),
        engine=EngineConfig(
            model=str(tiny_llama_dir), lora_modules=[LoRAModule(name="sql", path="/ad/sql")]
        ),
    )
    qwen = ModelSettings(
        name="qwen", model_dir=str(tiny_qwen2_dir), engine=EngineConfig(model=str(tiny_qwen2_dir))
    )
    return IngressSettings(
        model_name="llama",
        model_dir=llama.model_dir,
        engine=llama.engine,
        models=[llama, qwen],
        routing=RoutingConfig(),
    )


def _core(settings, registry=None) -> IngressCore:
    handles = {"llama": _handle(64), "qwen": _handle(128)}
    return IngressCore(handles, settings, registry=registry)


def test_a_request_goes_to_the_model_or_adapter_it_names(settings):
    core = _core(settings)

    async def run():
        assert await core.resolve(None) == (core.models["llama"], None)  # the first model
        assert await core.resolve("qwen") == (core.models["qwen"], None)
        model, lora = await core.resolve("sql")  # a static adapter: its base model
        assert model is core.models["llama"] and lora == LoRARequest("sql", "/ad/sql")
        with pytest.raises(HTTPError) as info:
            await core.resolve("gpt-4")
        return info.value

    err = asyncio.run(run())
    assert err.status == 404 and err.code == "model_not_found" and err.param == "model"
    assert "'gpt-4' does not exist" in err.message
    assert "['llama', 'qwen']" in err.message and "['sql']" in err.message


def test_each_model_has_its_own_tokenizer_and_an_adapter_its_base_models(settings):
    core = _core(settings)
    asyncio.run(asyncio.wait_for(core.tokenizer_loaded(), 60))
    llama, qwen = core.models["llama"], core.models["qwen"]
    assert llama.tokenizer is not qwen.tokenizer
    assert llama.dialect(True, "sql").model_name == "sql"  # responses name the adapter
    assert llama.dialect(True, "sql").tokenizer is llama.tokenizer
    assert qwen.dialect(False, "qwen") is qwen.dialects[False]


def test_models_lists_every_model_then_every_adapter_as_vllm_does(settings):
    core = _core(settings)
    cards = asyncio.run(core.list_models())
    rows = [(c.id, c.root, c.parent, c.max_model_len) for c in cards]
    assert rows == [
        ("llama", "llama", None, 64),
        ("qwen", "qwen", None, 128),
        ("sql", "/ad/sql", "llama", 64),
    ]


def test_an_adapter_loaded_on_one_ingress_is_served_by_the_others(settings, monkeypatch):
    registry = LoRARegistry()  # the application's actor, here in-process
    first, second = _core(settings, registry), _core(settings, registry)

    async def run():
        assert await second.resolve(None) == (second.models["llama"], None)  # cached: fresh
        assert await first.adapters.add(Adapter("chat", "qwen", "/ad/chat"))
        # `second` read the registry a moment ago, but a name it does not know reads it again
        model, lora = await second.resolve("chat")
        assert model is second.models["qwen"] and lora == LoRARequest("chat", "/ad/chat")
        assert not await second.adapters.add(Adapter("chat", "llama", "/elsewhere"))  # taken
        assert not await second.adapters.add(Adapter("sql", "llama", "/elsewhere"))  # static

        assert await first.adapters.remove("chat") == Adapter("chat", "qwen", "/ad/chat")
        with pytest.raises(HTTPError):  # the ingress that unloaded it: at once
            await first.resolve("chat")
        assert (await second.resolve("chat"))[1] is not None  # the other: its cached copy
        monkeypatch.setattr(router.lora_registry, "REFRESH_S", 0.0)  # ... until it refreshes
        with pytest.raises(HTTPError) as info:
            await second.resolve("chat")
        assert info.value.code == "model_not_found"

        # a static adapter unloads too, and can be loaded again
        assert await second.adapters.remove("sql") is not None
        with pytest.raises(HTTPError):
            await first.resolve("sql")
        assert await second.adapters.remove("sql") is None  # gone: nothing to unload
        assert await first.adapters.add(Adapter("sql", "llama", "/ad/sql2"))
        assert (await second.resolve("sql"))[1] == LoRARequest("sql", "/ad/sql2")

    asyncio.run(run())
