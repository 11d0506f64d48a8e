"""/v1/embeddings end to end over real Ray Serve and HTTP, on a model that serves chat too: the
official `openai` client (base64, its default, and float; a batch; token ids; Matryoshka
`dimensions`) and LangChain's OpenAIEmbeddings, each vector equal to transformers' pooled
last_hidden_state; an embeddings request answered while a chat stream runs on the replica."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402

APP = "stepserve-embeddings"
MODEL = "tiny"
TEXTS = ["The quick brown fox", "jumps over the lazy dog, again and again and again"]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama, declared a Matryoshka model (dimensions 16 and 32 of its 64)."""
    out = tmp_path_factory.mktemp("tiny-llama-matryoshka") / "model"
    shutil.copytree(tiny_llama_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def url(model_dir, shared_serve):
    port = shared_serve.port
    config = ClusterConfig.model_validate(
        {
            "name": APP,
            "engine": {
                "model": str(model_dir),
                "served_model_name": MODEL,
                "max_model_len": 256,
                "max_num_seqs": 8,
                "max_num_batched_tokens": 32,  # a long input spans steps
                "num_kv_blocks": 128,
                "block_size": 16,
            },
            "replicas": 1,
            "num_cpus_per_replica": 0.5,
            "http": {"host": "127.0.0.1", "port": port},
        }
    )
    base = shared_serve.url
    serve.run(build_app(config), name=APP, route_prefix="/")
    yield base


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' last-token final hidden state of a text (or token ids), normalized."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def embed(given, dimensions=None) -> list[float]:
        ids = tokenizer.encode(given) if isinstance(given, str) else given
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden[:dimensions], dim=0).tolist()

    embed.tokenizer = tokenizer
    return embed


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def assert_close(got, want) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_openai_client_base64_default_float_batch_tokens_and_dimensions(client, reference):
    # the client asks for base64 unless told otherwise, and decodes it
    one = client.embeddings.create(model=MODEL, input=TEXTS[0])
    assert one.model == MODEL and len(one.data) == 1 and one.data[0].index == 0
    assert_close(one.data[0].embedding, reference(TEXTS[0]))
    ids = reference.tokenizer.encode(TEXTS[0])
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)

    batch = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1]
    for item, text in zip(batch.data, TEXTS):
        assert len(item.embedding) == 64
        assert_close(item.embedding, reference(text))

    tokens = [[5, 17, 99, 3], list(range(3, 103))]  # the second spans steps (32-token budget)
    by_ids = client.embeddings.create(model=MODEL, input=tokens, encoding_format="float")
    for item, given in zip(by_ids.data, tokens):
        assert_close(item.embedding, reference(given))

    cut = client.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=16)
    assert len(cut.data[0].embedding) == 16
    assert_close(cut.data[0].embedding, reference(TEXTS[1], 16))

    with pytest.raises(openai.BadRequestError, match="choose one of \\[16, 32\\]"):
        client.embeddings.create(model=MODEL, input="x", dimensions=20)
    with pytest.raises(openai.BadRequestError, match="input 0 has 300 tokens, over max_model_len"):
        client.embeddings.create(model=MODEL, input=[[7] * 300])


def test_langchain_openai_embeddings(url, reference):
    lc = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length=False: LangChain would otherwise send tiktoken's token ids
    # (OpenAI's vocabulary), not the text
    embeddings = lc.OpenAIEmbeddings(
        model=MODEL,
        base_url=f"{url}/v1",
        api_key="unused",
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    documents = embeddings.embed_documents(TEXTS)
    assert len(documents) == 2
    for vector, text in zip(documents, TEXTS):
        assert_close(vector, reference(text))
    assert_close(embeddings.embed_query("a query"), reference("a query"))


def test_embeddings_are_answered_while_a_chat_stream_runs(url, reference):
    """One model serves both: a chat stream is generating on the replica when an
    embeddings request arrives; the embedding comes back right, and the stream ends whole."""

    async def body():
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                     timeout=120)  # fmt: skip
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "tell me a story"}],
            max_tokens=120,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = []
        first = await anext(aiter(stream))  # the chat is running now
        embedded = asyncio.ensure_future(
            aclient.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        )
        chunks.append(first)
        async for chunk in stream:
            chunks.append(chunk)
        return chunks, await embedded

    chunks, embedded = asyncio.run(asyncio.wait_for(body(), 180))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length" and text
    for item, given in zip(embedded.data, TEXTS):
        assert_close(item.embedding, reference(given))
