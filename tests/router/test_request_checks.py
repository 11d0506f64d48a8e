"""Each request check in one place: SamplingParams' bounds (their errors name the field), the
engine's check (EngineLimits) that the ingress runs before routing, and the HTTP layer's
mapping of an error's field onto the request field the client sent."""

from __future__ import annotations

import asyncio
import pickle
import types

import pytest

from replica.api import (
    SAMPLING_BOUNDS,
    EngineLimits,
    GrammarRejected,
    RequestRejected,
    SamplingParams,
    StructuredOutput,
)
from replica.config import EngineConfig
from router.errors import HTTPError
from router.ingress_core import IngressCore
from router.policy import RoutingConfig
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.settings import IngressSettings

USER = [{"role": "user", "content": "hi"}]
INFO = {"max_model_len": 64, "vocab_size": 100, "num_kv_blocks": 12, "block_size": 4}


def test_rejections_keep_their_field_through_pickling() -> None:
    for exc in (RequestRejected("bad", "top_p"), GrammarRejected("no grammar")):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.param == exc.param
    assert GrammarRejected("x").param == "structured" and RequestRejected("x").param is None


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"temperature": 2.5}, "temperature", "temperature must be in [0, 2], got 2.5"),
        ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        ({"top_k": -3}, "top_k", "top_k must be -1, 0 (disabled) or >= 1, got -3"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"seed": 2**63}, "seed", "seed must be in [-9223372036854775808, 9223372036854775807]"),
        ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens", "min_tokens (5) must be <= max"),
        ({"logit_bias": {5: 101.0}}, "logit_bias", "logit_bias[5] must be in [-100, 100]"),
        ({"stop": ["a", ""]}, "stop", "stop strings must be non-empty"),
        (
            {"ignore_eos": True, "structured": StructuredOutput("json_object")},
            "ignore_eos",
            "ignore_eos cannot be combined",
        ),
    ],
)
def test_sampling_params_name_the_field_limit_and_value(fields, param, message) -> None:
    with pytest.raises(RequestRejected) as info:
        SamplingParams(**fields)
    assert message in str(info.value) and info.value.param == param


def test_every_bound_is_a_sampling_params_field() -> None:
    assert set(SAMPLING_BOUNDS) <= set(SamplingParams.__dataclass_fields__)


def test_engine_limits_refuse_what_the_engine_never_serves() -> None:
    limits = EngineLimits.from_model_info(INFO, "fcfs")
    ok = SamplingParams(max_tokens=8)
    limits.check([1, 2, 3], ok)
    cases = [
        (([], ok, 0), "prompt", "at least one token"),
        (([1, 100], ok, 0), "prompt", "prompt token id 100 is outside the vocabulary [0, 100)"),
        (([1] * 64, ok, 0), "prompt", "prompt has 64 tokens, which leaves no room"),
        (([1] * 41, ok, 0), "max_tokens", "49 tokens = 13 KV blocks of 4, but the whole KV"),
        (([1], ok, 2), "priority", "priority=2 needs scheduling_policy='priority'"),
        (([1], SamplingParams(logit_bias={100: 1.0}), 0), "logit_bias", "logit_bias token id"),
    ]
    for args, param, message in cases:
        with pytest.raises(RequestRejected) as info:
            limits.check(*args)
        assert message in str(info.value) and info.value.param == param, args
    # a policy the replica did not report and the caller does not know: not checked
    EngineLimits.from_model_info(INFO).check([1], ok, priority=2)
    assert EngineLimits.from_model_info({**INFO, "scheduling_policy": "priority"}, "fcfs")


def test_chat_maps_sampling_fields_onto_its_own_names() -> None:
    chat = ChatCompletionRequest.model_validate(
        {"messages": USER, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2}
    )
    assert chat.request_field("max_tokens") == "max_completion_tokens"
    assert chat.request_field("logprobs") == "top_logprobs"
    assert chat.request_field("prompt") == "messages"
    legacy = ChatCompletionRequest.model_validate({"messages": USER, "max_tokens": 4})
    assert legacy.request_field("max_tokens") == "max_tokens"
    regex = ChatCompletionRequest.model_validate({"messages": USER, "guided_regex": "a+"})
    assert regex.request_field("structured") == "guided_regex"
    with pytest.raises(RequestRejected) as info:
        regex.model_copy(update={"ignore_eos": True}).to_sampling_params(8)
    assert info.value.param == "ignore_eos"
    with pytest.raises(RequestRejected) as info:
        CompletionRequest.model_validate(
            {"prompt": "x", "max_tokens": None, "min_tokens": 9}
        ).to_sampling_params(8)
    assert info.value.param == "min_tokens"
    with pytest.raises(RequestRejected) as info:
        CompletionRequest.model_validate({"prompt": "x", "guided_json": "{"}).to_sampling_params(8)
    assert info.value.param == "guided_json" and "not valid JSON" in str(info.value)


def _core(policy: str = "fcfs") -> IngressCore:
    async def model_info():
        return INFO

    handle = types.SimpleNamespace(
        options=lambda **_: handle, model_info=types.SimpleNamespace(remote=model_info)
    )
    settings = IngressSettings(
        model_name="m",
        model_dir="unused",
        engine=EngineConfig(model="unused", scheduling_policy=policy),
        routing=RoutingConfig(),
    )
    return IngressCore(handle, settings, tokenizer=types.SimpleNamespace(chat_template=None))


@pytest.mark.parametrize(
    ("body", "ids", "status_param", "message"),
    [
        ({"prompt": "x"}, [1, 100], "prompt", "prompt token id 100 is outside the vocabulary"),
        ({"messages": USER}, [1] * 64, "messages", "prompt has 64 tokens, which leaves no room"),
        ({"prompt": "x", "max_tokens": 30}, [1] * 40, "max_tokens", "exceeds max_model_len=64"),
        (
            {"messages": USER, "max_completion_tokens": 20},
            [1] * 40,
            "max_completion_tokens",
            "the whole KV cache has 12 blocks",
        ),  # fmt: skip
        ({"prompt": "x", "priority": 3}, [1], "priority", "needs scheduling_policy='priority'"),
        ({"prompt": "x", "logit_bias": {"100": 1}}, [1], "logit_bias", "logit_bias token id 100"),
        (
            {"prompt": "x", "max_tokens": None, "min_tokens": 10},
            [1] * 60,
            "min_tokens",
            "min_tokens (10) must be <= max_tokens (4)",
        ),  # fmt: skip
    ],
)
def test_the_ingress_refuses_before_routing_naming_the_request_field(
    body, ids, status_param, message
) -> None:
    cls = ChatCompletionRequest if "messages" in body else CompletionRequest
    req = cls.model_validate(body)
    with pytest.raises(HTTPError) as info:
        asyncio.run(_core().sampling_for(req, ids))
    err = info.value
    assert (err.status, err.param) == (400, status_param) and message in err.message, err.message


def test_the_ingress_passes_what_the_engine_serves() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 30, "priority": 3})
    params = asyncio.run(_core("priority").sampling_for(req, [1] * 18))  # 12 blocks: all
    assert params.max_tokens == 30
