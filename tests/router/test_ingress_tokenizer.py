"""The ingress's tokenizer loads in a thread while the ingress starts (without Ray): the
ingress is constructed without waiting for it, a request that comes first waits for it, and a
load that fails fails the requests that need it, naming the cause, until a load succeeds."""

from __future__ import annotations

import asyncio
import threading

import pytest

import replica.tokenizer
from replica.config import EngineConfig
from router.ingress import IngressCore
from router.policy import RoutingConfig
from router.settings import IngressSettings


class _Handle:  # the LLM deployment's handle: not called here
    def options(self, **_):
        return self


def _core(model_dir) -> IngressCore:
    settings = IngressSettings(
        model_name="m",
        model_dir=str(model_dir),
        engine=EngineConfig(model=str(model_dir)),
        routing=RoutingConfig(),
    )
    return IngressCore(_Handle(), settings)


def test_the_ingress_starts_before_its_tokenizer_and_requests_wait_for_it(
    tiny_llama_dir, monkeypatch
):
    release = threading.Event()
    real_load = replica.tokenizer.load_tokenizer
    monkeypatch.setattr(
        replica.tokenizer, "load_tokenizer", lambda d: release.wait(60) and real_load(d)
    )
    core = _core(tiny_llama_dir)  # returns while the load is held
    assert core.tokenizer is None

    async def body():
        waiting = asyncio.ensure_future(core.tokenizer_loaded())
        await asyncio.sleep(0.3)
        assert not waiting.done()
        release.set()
        await asyncio.wait_for(waiting, 60)
        await core.tokenizer_loaded()  # loaded: returns at once

    asyncio.run(body())
    want = real_load(tiny_llama_dir)
    assert core.tokenizer is not None and core.dialects.keys() == {False, True}
    assert core.tokenizer.encode("hello world") == want.encode("hello world")


def test_a_tokenizer_that_fails_to_load_fails_requests_until_it_loads(tiny_llama_dir, monkeypatch):
    real_load = replica.tokenizer.load_tokenizer
    # the thread's load fails, then the first request's; the second request's succeeds
    failures = [OSError(f"no tokenizer files in {tiny_llama_dir}")] * 2

    def load(model_dir):
        if failures:
            raise failures.pop()
        return real_load(model_dir)

    monkeypatch.setattr(replica.tokenizer, "load_tokenizer", load)
    core = _core(tiny_llama_dir)

    async def body():
        await asyncio.sleep(0.2)  # the thread's load has failed by now
        with pytest.raises(OSError, match="no tokenizer files"):
            await core.tokenizer_loaded()
        await core.tokenizer_loaded()  # tried again: loads

    asyncio.run(body())
    assert core.tokenizer is not None


def test_the_ingress_freezes_its_heap_once_its_tokenizer_has_loaded(tiny_llama_dir, monkeypatch):
    """The tokenizer's load (transformers' import) is the last of the ingress's start: then its
    heap is frozen out of the garbage collector's passes (replica/startup.py); not before, and
    not after a load that failed."""
    import router.ingress_core

    frozen = []
    monkeypatch.setattr(router.ingress_core, "freeze_heap", lambda: frozen.append(True))
    release = threading.Event()
    real_load = replica.tokenizer.load_tokenizer
    monkeypatch.setattr(
        replica.tokenizer, "load_tokenizer", lambda d: release.wait(60) and real_load(d)
    )
    core = _core(tiny_llama_dir)
    assert not frozen  # still loading
    release.set()
    asyncio.run(asyncio.wait_for(core.tokenizer_loaded(), 60))
    deadline = threading.Event()
    for _ in range(100):  # the load's thread calls it right after the load
        if frozen:
            break
        deadline.wait(0.05)
    assert frozen == [True]

    def fail(model_dir):
        raise OSError("no tokenizer files")

    frozen.clear()
    monkeypatch.setattr(replica.tokenizer, "load_tokenizer", fail)
    _core(tiny_llama_dir)
    deadline.wait(0.5)
    assert not frozen
