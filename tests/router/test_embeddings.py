"""POST /v1/embeddings at the ingress (no Ray): the OpenAI shape (float and base64, one input or a
batch of texts or token ids, in order, usage), one pooling request per input carrying the
model's pooling type, `normalize` and `dimensions`, and a 400 naming the field, value and
limit for every input the model cannot take."""

from __future__ import annotations

import base64
import struct
import types

import httpx
import pytest
from fastapi import FastAPI, Request

from replica.api import RequestOutput
from replica.config import EngineConfig
from router.embeddings import serve_embeddings
from router.errors import guarded
from router.ingress_core import IngressCore
from router.policy import RoutingConfig
from router.protocol import MAX_EMBEDDING_INPUTS
from router.settings import IngressSettings

INFO = {"max_model_len": 32, "vocab_size": 512, "num_kv_blocks": 64, "block_size": 4,
        "embedding": {"hidden_size": 64, "matryoshka": None}}  # fmt: skip


class FakeReplica:
    """A handle whose generate_all answers a pooling request with a vector made from its
    prompt (and remembers each request it was sent)."""

    def __init__(self, info: dict) -> None:
        self.info = info
        self.sent = []
        self.model_info = types.SimpleNamespace(remote=self._model_info)
        self.generate_all = types.SimpleNamespace(remote=self._generate_all)

    def options(self, **_):
        return self

    async def _model_info(self):
        return self.info

    async def _generate_all(self, request):
        self.sent.append(request)
        ids = request.prompt_token_ids
        vector = [float(len(ids)), float(sum(ids)), 0.5]
        return RequestOutput(request.request_id, [], "", len(ids), 0, "stop", embedding=vector)


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def client(tokenizer, info=INFO, **engine_fields):
    replica = FakeReplica(info)
    settings = IngressSettings(
        model_name="m",
        model_dir="unused",
        engine=EngineConfig(model="unused", **engine_fields),
        routing=RoutingConfig(),
    )
    core = IngressCore(replica, settings, tokenizer=tokenizer)
    app = FastAPI()

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await guarded(serve_embeddings, core, request)

    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://test"), replica


async def post(tokenizer, body, **kwargs):
    http, replica = client(tokenizer, **kwargs)
    async with http:
        response = await http.post("/v1/embeddings", json=body)
    return response, replica


@pytest.mark.anyio
async def test_one_text_as_floats_in_openai_shape(tokenizer):
    response, replica = await post(tokenizer, {"input": "hello world", "model": "m"})
    assert response.status_code == 200, response.text
    body = response.json()
    ids = tokenizer.encode("hello world")
    assert body == {
        "object": "list",
        "data": [{"object": "embedding", "index": 0,
                  "embedding": [float(len(ids)), float(sum(ids)), 0.5]}],
        "model": "m",
        "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids)},
    }  # fmt: skip
    (sent,) = replica.sent
    assert sent.prompt_token_ids == ids
    assert (sent.pooling.kind, sent.pooling.normalize, sent.pooling.dimensions) == (
        "last",
        True,
        None,
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    "given", [["a b", "c"], [[5, 6, 7], [9]], [3, 4, 5, 6]], ids=["texts", "token-lists", "tokens"]
)
async def test_a_batch_fans_out_one_request_per_input_in_order(tokenizer, given):
    response, replica = await post(tokenizer, {"input": given, "encoding_format": "base64"},
                                   pooling_type="mean")  # fmt: skip
    assert response.status_code == 200, response.text
    prompts = [tokenizer.encode(g) if isinstance(g, str) else g for g in given]
    if isinstance(given[0], int):
        prompts = [given]
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(prompts)))
    for item, ids in zip(data, prompts):
        raw = base64.b64decode(item["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == [len(ids), sum(ids), 0.5]
    assert sorted(r.prompt_token_ids for r in replica.sent) == sorted(prompts)
    assert {r.pooling.kind for r in replica.sent} == {"mean"}
    assert len({r.request_id for r in replica.sent}) == len(prompts)
    total = sum(len(p) for p in prompts)
    assert response.json()["usage"] == {"prompt_tokens": total, "total_tokens": total}


@pytest.mark.anyio
async def test_normalize_user_and_matryoshka_dimensions_reach_the_engine(tokenizer):
    info = {**INFO, "embedding": {"hidden_size": 64, "matryoshka": [16, 32]}}
    body = {"input": "x", "dimensions": 16, "normalize": False, "user": "u-1",
            "encoding_format": None}  # fmt: skip
    response, replica = await post(tokenizer, body, info=info)
    assert response.status_code == 200, response.text
    assert replica.sent[0].pooling.dimensions == 16
    assert replica.sent[0].pooling.normalize is False
    any_width = {**INFO, "embedding": {"hidden_size": 64, "matryoshka": True}}
    response, replica = await post(tokenizer, {"input": "x", "dimensions": 7}, info=any_width)
    assert response.status_code == 200 and replica.sent[0].pooling.dimensions == 7


TOO_MANY = ["x"] * (MAX_EMBEDDING_INPUTS + 1)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("body", "info", "param", "message"),
    [
        ({"input": ""}, INFO, "input", "input[0] is empty"),
        ({"input": ["a", ""]}, INFO, "input", "input[1] is empty"),
        ({"input": []}, INFO, "input", "input must not be empty"),
        ({"input": [[1], []]}, INFO, "input", "input[1] is empty"),
        ({"input": {"a": 1}}, INFO, "input", "input must be a string, a list of strings"),
        ({"input": [1, -2]}, INFO, "input", "input[0] has token id -2: ids must be >= 0"),
        ({"input": TOO_MANY}, INFO, "input", "input has 2049 items, more than the limit of 2048"),
        ({"input": [[1], [1] * 33]}, INFO, "input", "input 1 has 33 tokens, over max_model_len=32"),
        ({"input": [[1], [2, 512]]}, INFO, "input",
         "input 1: prompt token id 512 is outside the vocabulary [0, 512)"),
        ({"input": "x", "dimensions": 8}, INFO, "dimensions",
         "dimensions=8 is not supported by the model 'm': it is not a Matryoshka model"),
        ({"input": "x", "dimensions": 65}, INFO, "dimensions",
         "dimensions=65 is more than the model 'm''s embedding size of 64"),
        ({"input": "x", "dimensions": 20},
         {**INFO, "embedding": {"hidden_size": 64, "matryoshka": [16, 32]}}, "dimensions",
         "dimensions=20 is not one the model 'm' was trained for: choose one of [16, 32]"),
        ({"input": "x", "dimensions": 0}, INFO, "dimensions", "dimensions must be >= 1, got 0"),
        ({"input": "x", "encoding_format": "int8"}, INFO, "encoding_format",
         "encoding_format: Input should be 'float' or 'base64'"),
        ({"input": "x", "truncate_prompt_tokens": 5}, INFO, "truncate_prompt_tokens",
         "unrecognized request field 'truncate_prompt_tokens'"),
    ],
)  # fmt: skip
async def test_what_the_model_cannot_take_is_a_400_naming_it(tokenizer, body, info, param, message):
    response, replica = await post(tokenizer, body, info=info)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param, error
    assert replica.sent == []


@pytest.mark.anyio
async def test_an_unknown_model_is_404(tokenizer):
    response, _ = await post(tokenizer, {"input": "x", "model": "nope"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.anyio
async def test_a_prompt_may_fill_max_model_len(tokenizer):
    response, replica = await post(tokenizer, {"input": [1] * 32})
    assert response.status_code == 200 and len(replica.sent[0].prompt_token_ids) == 32


@pytest.fixture
def anyio_backend():
    return "asyncio"
