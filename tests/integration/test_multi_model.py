"""Two models and their LoRA adapters behind one port, end to end over real Ray Serve and
HTTP through the official `openai` client: each model answers (chat and completions, streamed
and not) under its own name, /v1/models lists models and adapters, an unknown name is 404
model_not_found naming what is served, adapters load and unload at run time (a stream running
on one finishes; a new request gets 404), and the load endpoints need the API key.

Tests marked `needs_engine_lora` need the replica side of LoRA (LLMServer.load_lora and an
engine that applies adapters): they skip until it is merged."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from replica.deployment import LLMServer  # noqa: E402
from router.lora_registry import kill_registry  # noqa: E402

APP = "stepserve-multi-model"
KEY = "sk-multi-model-test"
needs_engine_lora = pytest.mark.skipif(
    not hasattr(LLMServer, "load_lora"),
    reason="waits for the engine branch: LLMServer.load_lora / unload_lora",
)


def engine(model_dir, name: str, adapters: list[dict]) -> dict:
    return {
        "model": str(model_dir),
        "served_model_name": name,
        "max_model_len": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "num_kv_blocks": 64,
        "block_size": 16,
        "engine_core": "thread",  # one process less per replica: a quicker start on 2 cores
        "enable_lora": True,
        "max_lora_rank": 8,
        "lora_modules": adapters,
    }


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_dir, tiny_qwen2_dir) -> dict:
    from replica.tiny_lora import build_tiny_adapter

    root = tmp_path_factory.mktemp("adapters")
    made = {
        "llama-sql": build_tiny_adapter(tiny_llama_dir, root / "llama-sql", rank=4, seed=1),
        "qwen-chat": build_tiny_adapter(tiny_qwen2_dir, root / "qwen-chat", rank=4, seed=2),
        "llama-extra": build_tiny_adapter(tiny_llama_dir, root / "llama-extra", rank=4, seed=3),
    }
    return {name: str(path) for name, path in made.items()}


@pytest.fixture(scope="module")
def url(tiny_llama_dir, tiny_qwen2_dir, adapters, shared_serve):
    port = shared_serve.port
    config = ClusterConfig.model_validate(
        {
            "name": APP,
            "models": [
                {
                    "engine": engine(
                        tiny_llama_dir,
                        "llama",
                        [{"name": "llama-sql", "path": adapters["llama-sql"]}],
                    )
                },
                {
                    "engine": engine(
                        tiny_qwen2_dir,
                        "qwen",
                        [{"name": "qwen-chat", "path": adapters["qwen-chat"]}],
                    )
                },
            ],
            "replicas": 1,
            "num_cpus_per_replica": 0.25,
            "http": {"host": "127.0.0.1", "port": port},
            "auth": {"api_keys": [KEY]},
        }
    )
    base = shared_serve.url
    serve.run(build_app(config), name=APP, route_prefix="/")
    try:
        yield base
    finally:
        kill_registry(APP)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(url: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize("model", ["llama", "qwen"])
def test_each_model_answers_chat_and_completions_under_its_name(client, model):
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert chat.model == model and chat.usage.completion_tokens > 0
    done = client.completions.create(model=model, prompt="The fox", max_tokens=6, temperature=0)
    assert done.model == model and done.usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    assert {c.model for c in chunks} == {model}
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    streamed = client.completions.create(
        model=model, prompt="The fox", max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == done.choices[0].text  # greedy: the same answer streamed or not


def greedy_text(client, model: str) -> str:
    """12 greedy tokens of "The fox" from `model` (a model or an adapter)."""
    completion = client.completions.create(
        model=model, prompt="The fox", max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return completion.choices[0].text


def test_the_two_models_are_different_models(client):
    """Each name reaches its own checkpoint (a mix-up would answer alike)."""
    assert greedy_text(client, "llama") != greedy_text(client, "qwen")


def test_a_request_without_model_goes_to_the_first(url):
    r = post(url, "/v1/completions", {"prompt": "The fox", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == "llama"


def test_models_lists_both_models_and_both_adapters(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"llama", "qwen", "llama-sql", "qwen-chat"}
    assert cards["llama-sql"].parent == "llama" and cards["llama-sql"].root == adapters["llama-sql"]
    assert cards["qwen-chat"].parent == "qwen" and cards["qwen-chat"].root == adapters["qwen-chat"]
    assert getattr(cards["llama"], "parent", None) is None
    assert all(card.max_model_len == 256 for card in cards.values())


@pytest.mark.parametrize("name", ["gpt-4", "llama-sq"])
def test_an_unknown_model_or_adapter_is_404_model_not_found_naming_the_models(client, name):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert name in error["message"] and "'llama', 'qwen'" in error["message"]


def test_a_static_adapter_answers_under_its_name(client):
    out = client.chat.completions.create(
        model="qwen-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert out.model == "qwen-chat" and out.usage.completion_tokens > 0


def test_tokenize_takes_the_model_and_an_adapter_uses_its_base_models_tokenizer(url):
    def ids(model):
        r = post(url, "/tokenize", {"model": model, "prompt": "hello world"})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert ids("llama-sql") == ids("llama")
    assert post(url, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    r = post(url, "/detokenize", {"model": "qwen", "tokens": ids("qwen")})
    assert r.json()["prompt"].endswith("hello world")


def test_the_adapter_endpoints_need_the_api_key(url, adapters):
    body = {"lora_name": "x", "lora_path": adapters["llama-extra"]}
    assert post(url, "/v1/load_lora_adapter", body, key=None).status_code == 401
    assert post(url, "/v1/load_lora_adapter", body, key="wrong").status_code == 401
    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "llama-sql"}, key=None)
    assert r.status_code == 401
    assert "llama-sql" in {
        m["id"]
        for m in httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()[
            "data"
        ]
    }


def test_adapter_endpoint_refusals_name_the_value(url, adapters):
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "qwen", "lora_path": "/x"})
    assert r.status_code == 400 and "'qwen' has already been loaded" in r.json()["error"]["message"]
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "llama-sql", "lora_path": "/x"})
    assert r.status_code == 400 and "'llama-sql' has already been loaded" in r.text
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x", "model": "m"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 404 and "'never-loaded' cannot be found" in r.text


@needs_engine_lora
def test_a_bad_adapter_path_is_a_400_naming_the_adapter(url, tmp_path):
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "bad" in r.json()["error"]["message"]
    assert post(url, "/v1/chat/completions", {"model": "bad", "messages": []}).status_code in (
        400,
        404,
    )


@needs_engine_lora
def test_an_adapter_changes_the_answer_of_its_base_model(client):
    assert greedy_text(client, "llama-sql") != greedy_text(client, "llama")


@needs_engine_lora
def test_load_then_unload_while_a_stream_runs_on_the_adapter(client, url, adapters):
    body = {"lora_name": "llama-extra", "lora_path": adapters["llama-extra"], "model": "llama"}
    r = post(url, "/v1/load_lora_adapter", body)
    assert r.status_code == 200 and "llama-extra" in r.text
    cards = {m.id: m for m in client.models.list().data}
    assert cards["llama-extra"].parent == "llama"
    assert post(url, "/v1/load_lora_adapter", body).status_code == 400  # loaded already

    stream = client.completions.create(
        model="llama-extra",
        prompt="The fox",
        max_tokens=120,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.model == "llama-extra"
    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "llama-extra"})
    assert r.status_code == 200 and "removed" in r.text
    with pytest.raises(openai.NotFoundError):  # a new request: 404 at once
        client.completions.create(model="llama-extra", prompt="x", max_tokens=2)
    rest = list(chunks)  # the running stream finishes
    assert rest[-1].choices[0].finish_reason == "length"
    assert "llama-extra" not in {m.id for m in client.models.list().data}
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "llama-extra"}).status_code == 404


def test_metrics_carry_each_models_name(url):
    import time

    deadline = time.monotonic() + 30  # replicas push their metrics about once a second
    while True:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        if 'model_name="llama"' in text and 'model_name="qwen"' in text:
            break
        assert time.monotonic() < deadline, "both models' replica metrics on /metrics"
        time.sleep(1)
