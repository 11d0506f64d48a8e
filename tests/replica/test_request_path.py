"""One typed request from the ingress to the scheduler: the EngineRequest the protocol builds is
the one the scheduler's Request holds, field for field, through the fan-out (GenerateRequest.of),
the replica's front and either transport (a thread, or the core process's wire). A field added to
EngineRequest therefore needs no change on the way; these tests fail if a hop rebuilds the
request from a fixed list of its parts."""

from __future__ import annotations

import asyncio
import dataclasses

from replica.config import EngineConfig
from replica.contracts import GenerateRequest
from replica.engine import AsyncEngine, Engine, wire
from replica.request import (
    EngineRequest,
    KVFetch,
    LoRARequest,
    PoolingRequest,
    Resume,
    SamplingParams,
    StructuredOutput,
)
from router.fanout import ReplicaCalls
from router.policy import Policy, RoutingConfig
from router.protocol import ChatCompletionRequest


def every_field_set() -> EngineRequest:
    """An EngineRequest with no field at its default."""
    params = SamplingParams(max_tokens=5, temperature=0.5, seed=3, stop=["x"],
                            logit_bias={4: 1.0}, structured=StructuredOutput("regex", "a+"))  # fmt: skip
    request = EngineRequest([5, 6, 7], params, "rid", priority=2, arrival_time=12.5,
                            lora=LoRARequest("ad", "/adapters/ad"),
                            resume=Resume([8, 9], "ab", num_migrations=2),
                            pooling=PoolingRequest("mean", False, 8),
                            kv_fetch=KVFetch("replica-b", 3),
                            traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")  # fmt: skip
    defaults = EngineRequest([1], SamplingParams(), "")
    for field in dataclasses.fields(EngineRequest):
        assert getattr(request, field.name) != getattr(defaults, field.name), field.name
    return request


def test_the_fan_out_sends_every_field_of_the_choice():
    choice = every_field_set()
    calls = ReplicaCalls(handle=_NoHandle(), policy=Policy(RoutingConfig()), block_size=4)
    sent = calls.request(choice)
    assert isinstance(sent, GenerateRequest) and sent.request_id != choice.request_id
    for field in dataclasses.fields(EngineRequest):
        if field.name != "request_id":
            assert getattr(sent, field.name) == getattr(choice, field.name), field.name


def test_the_protocol_builds_the_engine_request():
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "priority": 3, "max_tokens": 4}
    )
    params = req.to_sampling_params(16)
    built = req.engine_request([1, 2], params)
    assert (built.prompt_token_ids, built.sampling, built.priority) == ([1, 2], params, 3)


def test_the_core_wire_carries_every_field():
    request = GenerateRequest.of(every_field_set(), prefix_key=9, reports_progress=True)
    back = wire.core_codec().decode(wire.front_codec().encode(wire.Add(request))).request
    assert back == every_field_set()  # the routing hints stay with the router


def test_the_scheduler_holds_the_request_as_sent(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64)
    # no adapter on this replica; a resume of no tokens yet (its text must match its tokens);
    # a generation (a pooling request ends at its first output)
    request = dataclasses.replace(every_field_set(), sampling=SamplingParams(max_tokens=50),
                                  priority=0, lora=None, resume=Resume([], "", 2),
                                  pooling=None)  # fmt: skip
    engine = AsyncEngine(Engine(config))

    async def body():
        stream = engine.generate(request)
        await anext(stream)
        held = await asyncio.wrap_future(
            engine.call_on_engine_thread(
                lambda e: e.scheduler.requests[request.request_id].engine_request
            )
        )
        await stream.aclose()
        return held

    try:
        assert asyncio.run(body()) == request
    finally:
        engine.shutdown()


class _NoHandle:
    def options(self, **_):
        return self
