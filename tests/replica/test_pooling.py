"""Pooling requests (EngineRequest.pooling, /v1/embeddings): the embedding is transformers'
pooled last_hidden_state (last token or mean, cut to `dimensions`, L2-normalized or not), run
by the same scheduler in the same batches as generation (chunked prefill, prefix-cache hits
for "last", preemption), whose greedy tokens stay as they were; in the engine core's process
and under tensor parallelism too."""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import pytest
import torch

from replica.config import EngineConfig
from replica.engine import AsyncEngine, Engine
from replica.engine.core_client import ProcessEngine
from replica.pooling import embedding_info
from replica.request import EngineRequest, PoolingRequest, RequestRejected, SamplingParams
from tests.replica.test_model_parity import greedy_params, mixed_prompts

EMBED_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def config(model_dir, **fields) -> EngineConfig:
    fields = {"device": "cpu", "block_size": 4, "num_kv_blocks": 256, "max_model_len": 128,
              "engine_core": "thread", **fields}  # fmt: skip
    return EngineConfig(model=str(model_dir), **fields)


@functools.lru_cache(maxsize=4)
def hf_model(model_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def hf_embedding(model_dir, prompt, kind="last", normalize=True, dimensions=None) -> torch.Tensor:
    """transformers' last_hidden_state (after the final norm), pooled as the engine pools."""
    with torch.no_grad():
        hidden = hf_model(str(model_dir))(torch.tensor([prompt])).last_hidden_state[0]
    vector = hidden[-1] if kind == "last" else hidden.mean(0)
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector


def embed_request(prompt, rid, kind="last", normalize=True, dimensions=None) -> EngineRequest:
    pooling = PoolingRequest(kind, normalize, dimensions)
    return EngineRequest(list(prompt), EMBED_PARAMS, rid, pooling=pooling)


def run(engine: Engine, requests: list[EngineRequest]) -> dict:
    """Every request to its end through engine.step; per id, (tokens, finish, output)."""
    for request in requests:
        engine.check_request(request)
        engine.add(request)
    tokens = {r.request_id: [] for r in requests}
    last = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            last[out.request_id] = out
        engine.scheduler.kv.check_invariants()
        steps += 1
        assert steps < 5000
    assert engine.num_request_states == 0
    assert engine.num_free_blocks == engine.num_kv_blocks, "blocks leaked"
    return {rid: (tokens[rid], last[rid]) for rid in tokens}


def assert_close(got, want) -> None:
    got = torch.tensor(got)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def chunked_engine(tiny_llama_dir):
    """A 16-token budget: the longer prompts span several steps."""
    engine = Engine(config(tiny_llama_dir, max_num_batched_tokens=16))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("kind", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_equal_transformers_batched_with_generation(
    tiny_llama_dir, chunked_engine, kind, normalize
):
    """Pooling requests of 1..45 tokens in the same steps as greedy generations, in chunks
    of at most 16 tokens: each embedding is transformers' pooled hidden state, each
    generation's tokens what it is alone."""
    engine = chunked_engine
    prompts = mixed_prompts(11, [45, 3, 1, 20, 33])
    gens = mixed_prompts(12, [9, 26])
    gen_requests = [
        EngineRequest(p, greedy_params(10), f"g{i}-{kind}-{normalize}") for i, p in enumerate(gens)
    ]
    alone = run(engine, gen_requests)
    gen_requests = [EngineRequest(r.prompt_token_ids, r.sampling, r.request_id + "b")
                    for r in gen_requests]  # fmt: skip
    embeds = [embed_request(p, f"e{i}-{kind}-{normalize}", kind, normalize)
              for i, p in enumerate(prompts)]  # fmt: skip
    mixed = run(engine, [gen_requests[0], *embeds, gen_requests[1]])
    for request, prompt in zip(embeds, prompts):
        tokens, out = mixed[request.request_id]
        assert tokens == [] and out.finish_reason == "stop"
        assert out.num_output_tokens == 0 and out.num_prompt_tokens == len(prompt)
        assert_close(out.embedding, hf_embedding(tiny_llama_dir, prompt, kind, normalize))
    for before, after in zip(alone.values(), [mixed[r.request_id] for r in gen_requests]):
        assert after[0] == before[0] and len(after[0]) == 10
        assert after[1].embedding is None


def test_dimensions_cut_before_normalizing(tiny_llama_dir, chunked_engine):
    prompt = mixed_prompts(13, [21])[0]
    outs = run(chunked_engine, [embed_request(prompt, "d8", "mean", True, 8),
                                embed_request(prompt, "d5", "last", False, 5)])  # fmt: skip
    assert_close(outs["d8"][1].embedding, hf_embedding(tiny_llama_dir, prompt, "mean", True, 8))
    assert_close(outs["d5"][1].embedding, hf_embedding(tiny_llama_dir, prompt, "last", False, 5))
    assert abs(sum(x * x for x in outs["d8"][1].embedding) - 1.0) < 1e-5


def test_last_reuses_cached_prefix_blocks_and_mean_runs_the_whole_prompt(
    tiny_llama_dir, chunked_engine
):
    prompt = mixed_prompts(14, [30])[0]
    want_last = hf_embedding(tiny_llama_dir, prompt, "last")
    want_mean = hf_embedding(tiny_llama_dir, prompt, "mean")
    first = run(chunked_engine, [embed_request(prompt, "c1")])["c1"][1]
    again = run(chunked_engine, [embed_request(prompt, "c2"),
                                 embed_request(prompt, "c3", "mean")])  # fmt: skip
    assert first.num_cached_tokens == 0
    # 30 tokens in blocks of 4: 7 full blocks hit, the last token computed
    assert again["c2"][1].num_cached_tokens == 28
    assert again["c3"][1].num_cached_tokens == 0
    assert_close(again["c2"][1].embedding, want_last)
    assert_close(again["c3"][1].embedding, want_mean)
    # and a generation after it hits the blocks the embedding left
    gen = run(chunked_engine, [EngineRequest(prompt + [5], greedy_params(2), "g-after")])
    assert gen["g-after"][1].num_cached_tokens == 28


def test_preempted_mean_pooling_starts_its_sum_again(tiny_llama_dir, chunked_engine):
    """A pooling request preempted after its first chunk (recompute): its mean is still over
    each prompt position once."""
    engine = chunked_engine
    prompt = mixed_prompts(15, [40])[0]
    request = embed_request(prompt, "m0", "mean")
    engine.check_request(request)
    state = engine.add(request)
    assert engine.step() == [] and state.pooled is not None
    scheduler = engine.scheduler
    scheduler.running.remove(state)
    scheduler._preempt(state)  # what a step short of KV blocks does to it
    assert state.pooled is None and state.num_computed_tokens == 0
    out = []
    while not out:
        out = engine.step()
    assert not engine.has_unfinished()
    assert_close(out[0].embedding, hf_embedding(tiny_llama_dir, prompt, "mean"))
    assert engine.num_free_blocks == engine.num_kv_blocks


def test_a_pooling_prompt_may_fill_max_model_len_and_not_more(tiny_llama_dir, chunked_engine):
    engine = chunked_engine
    full = mixed_prompts(17, [128])[0]
    out = run(engine, [embed_request(full, "full", "mean")])["full"][1]
    assert_close(out.embedding, hf_embedding(tiny_llama_dir, full, "mean"))
    with pytest.raises(RequestRejected, match="129 tokens, over max_model_len=128"):
        engine.check_request(embed_request(full + [3], "over"))
    with pytest.raises(RequestRejected, match="pooling kind"):
        engine.check_request(embed_request(full[:4], "odd", kind="cls"))


def test_embedding_info_reads_the_matryoshka_declaration():
    class Cfg:
        hidden_size = 64

    assert embedding_info(Cfg()) == {"hidden_size": 64, "matryoshka": None}
    cfg = Cfg()
    cfg.matryoshka_dimensions = [128, 32, 16]
    assert embedding_info(cfg) == {"hidden_size": 64, "matryoshka": [16, 32]}
    cfg = Cfg()
    cfg.is_matryoshka = True
    assert embedding_info(cfg)["matryoshka"] is True


async def _embed_async(engine, requests):
    async def one(request):
        merged = None
        async for out in engine.generate(request):
            merged = out if merged is None else merged.merge(out)
        return merged

    return await asyncio.gather(*(one(r) for r in requests))


@pytest.mark.timeout(120)
def test_the_engine_core_process_returns_the_same_embeddings(tiny_llama_dir):
    """engine_core "process": the pooling request crosses the wire, the embedding comes back;
    a generation in the same core is untouched."""
    prompts = mixed_prompts(18, [19, 7])
    requests = [embed_request(prompts[0], "p0", "mean"), embed_request(prompts[1], "p1", "last", False),
                EngineRequest(prompts[0], greedy_params(6), "p2")]  # fmt: skip

    async def body():
        engine = ProcessEngine(config(tiny_llama_dir, engine_core="process"))
        try:
            return await _embed_async(engine, requests)
        finally:
            engine.shutdown()

    outs = asyncio.run(asyncio.wait_for(body(), 100))
    assert_close(outs[0].embedding, hf_embedding(tiny_llama_dir, prompts[0], "mean"))
    assert_close(outs[1].embedding, hf_embedding(tiny_llama_dir, prompts[1], "last", False))
    assert outs[0].new_token_ids == [] and outs[0].finish_reason == "stop"
    assert len(outs[2].new_token_ids) == 6 and outs[2].embedding is None


@pytest.mark.timeout(120)
def test_thread_engine_streams_one_final_output(tiny_llama_dir):
    async def body():
        engine = AsyncEngine(Engine(config(tiny_llama_dir)))
        try:
            seen = []
            async for out in engine.generate(embed_request([5, 6, 7], "t0")):
                seen.append(out)
            return seen
        finally:
            engine.shutdown()

    seen = asyncio.run(asyncio.wait_for(body(), 100))
    assert len(seen) == 1 and seen[0].finished
    assert_close(seen[0].embedding, hf_embedding(tiny_llama_dir, [5, 6, 7]))


@pytest.mark.timeout(180)
def test_tp2_embeddings_equal_transformers(tiny_llama_dir):
    """tp=2 over gloo: every rank holds the whole hidden state; rank 0 pools it."""
    engine = Engine(config(tiny_llama_dir, tensor_parallel_size=2, max_num_batched_tokens=16))
    try:
        prompts = mixed_prompts(19, [23, 4])
        outs = run(engine, [embed_request(prompts[0], "t0", "mean"),
                            embed_request(prompts[1], "t1"),
                            EngineRequest(prompts[1], greedy_params(5), "t2")])  # fmt: skip
    finally:
        engine.shutdown()
    assert_close(outs["t0"][1].embedding, hf_embedding(tiny_llama_dir, prompts[0], "mean"))
    assert_close(outs["t1"][1].embedding, hf_embedding(tiny_llama_dir, prompts[1]))
    assert len(outs["t2"][0]) == 5


def causal_lm_embedding(model, prompt, kind="last") -> torch.Tensor:
    """A causal LM's final hidden state (transformers appends it after the last norm),
    pooled and normalized."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0]
    vector = hidden[-1] if kind == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vector, dim=0)


def test_gguf_quantized_embeddings_equal_transformers_dequantized(tiny_tokenizer_dir):
    """A GGUF checkpoint of quantized blocks (fp32 activations: exact kernels) pools as
    transformers' de-quantized reading of the same file."""
    from transformers import AutoTokenizer

    from tests.replica.quant_helpers import hf_gguf_model, tiny_gguf_dir

    sidecar = tiny_gguf_dir("llama")
    engine = Engine(
        config(sidecar, quant_activations="fp32", max_num_batched_tokens=16),
        tokenizer=AutoTokenizer.from_pretrained(tiny_tokenizer_dir),
    )
    try:
        prompts = mixed_prompts(20, [27, 6])
        outs = run(engine, [embed_request(prompts[0], "q0", "mean"),
                            embed_request(prompts[1], "q1")])  # fmt: skip
    finally:
        engine.shutdown()
    model = hf_gguf_model(sidecar)
    assert_close(outs["q0"][1].embedding, causal_lm_embedding(model, prompts[0], "mean"))
    assert_close(outs["q1"][1].embedding, causal_lm_embedding(model, prompts[1]))


def test_lora_adapter_embeddings_equal_peft(tiny_llama_dir, tmp_path):
    """EngineRequest.lora: the adapter's hidden states are pooled (peft's reference); the
    base model's differ."""
    from tests.replica.lora_helpers import _peft_model, make_adapters

    lora = make_adapters(tiny_llama_dir, tmp_path)["all8"]
    engine = Engine(config(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8))
    prompt = mixed_prompts(21, [15])[0]
    try:
        with_adapter = dataclasses.replace(embed_request(prompt, "l0"), lora=lora)
        outs = run(engine, [with_adapter, embed_request(prompt, "l1")])
    finally:
        engine.shutdown()
    want = causal_lm_embedding(_peft_model(tiny_llama_dir, lora.path), prompt)
    assert_close(outs["l0"][1].embedding, want)
    assert_close(outs["l1"][1].embedding, hf_embedding(tiny_llama_dir, prompt))
    assert not torch.allclose(want, hf_embedding(tiny_llama_dir, prompt), atol=1e-3)


def test_offline_llm_embed(tiny_llama_dir):
    from replica.engine import LLM

    with LLM(tiny_llama_dir, device="cpu", num_kv_blocks=64, pooling_type="mean") as llm:
        texts = ["hello there", "a longer sentence to embed"]
        vectors = llm.embed(texts + [[5, 6, 7]], normalize=False)
        generated = llm.generate("hello", greedy_params(3))[0].output_token_ids
    ids = [llm.tokenizer.encode(t) for t in texts] + [[5, 6, 7]]
    for vector, prompt in zip(vectors, ids):
        assert_close(vector, hf_embedding(tiny_llama_dir, prompt, "mean", False))
    assert len(generated) == 3
