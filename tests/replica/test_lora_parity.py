"""LoRA adapters in the engine: greedy fp32 output of one batch mixing three adapters (of
different ranks and targets, one with rsLoRA scaling) and the base model is token-identical
to transformers + peft, under chunked prefill, prefix caching (never across adapters),
preemption and two tensor-parallel ranks; on an int8-quantized base an adapter moves the
logits as it does on the float base."""

from __future__ import annotations

import pytest
import torch

from replica.config import EngineConfig
from replica.engine import LLM, Engine
from replica.request import LoRARequest
from replica.runner import StepBatch
from tests.replica.lora_helpers import expected, make_adapters, peft_greedy
from tests.replica.test_model_parity import MAX_TOKENS, PROMPT_LENGTHS, greedy_params, mixed_prompts

LORA_FIELDS = {
    "device": "cpu",
    "dtype": "float32",
    "block_size": 4,
    "num_kv_blocks": 256,
    "enable_lora": True,
    "max_loras": 4,
    "max_lora_rank": 8,
}


@pytest.fixture(scope="module")
def llama_adapters(tiny_llama_dir, tmp_path_factory):
    return make_adapters(tiny_llama_dir, tmp_path_factory.mktemp("llama-adapters"))


@pytest.fixture(scope="module")
def qwen2_adapters(tiny_qwen2_dir, tmp_path_factory):
    return make_adapters(tiny_qwen2_dir, tmp_path_factory.mktemp("qwen2-adapters"))


def mixed_batch(adapters: dict, seed: int = 0):
    """Prompts, each with an adapter (three adapters and the base model, interleaved)."""
    prompts = mixed_prompts(seed, PROMPT_LENGTHS)
    cycle = [*adapters.values(), None]
    loras = [cycle[i % len(cycle)] for i in range(len(prompts))]
    return prompts, loras


def generate(llm: LLM, prompts, loras, max_tokens):
    outs = llm.generate(prompts, [greedy_params(n) for n in max_tokens], lora=loras)
    return outs, [o.output_token_ids for o in outs]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mixed_adapter_batch_matches_peft(family, tiny_llama_dir, tiny_qwen2_dir, request):
    model_dir = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[family]
    adapters = request.getfixturevalue(f"{family}_adapters")
    prompts, loras = mixed_batch(adapters)
    want = expected(model_dir, prompts, loras, MAX_TOKENS)
    # the adapters change the output (else this test could not tell them apart)
    for prompt, lora, n, out in zip(prompts, loras, MAX_TOKENS, want):
        if lora is not None and len(prompt) > 4:
            assert out != peft_greedy(model_dir, None, tuple(prompt), n)
    with LLM(model_dir, **LORA_FIELDS) as llm:
        _, got = generate(llm, prompts, loras, MAX_TOKENS)
        assert sorted(llm.list_loras()) == sorted(adapters)  # loaded on demand
    assert got == want


def test_chunked_prefill_with_adapters_matches_peft(tiny_llama_dir, llama_adapters):
    prompts, loras = mixed_batch(llama_adapters, seed=1)
    with LLM(tiny_llama_dir, **LORA_FIELDS, max_num_batched_tokens=16) as llm:
        lora_model = llm.engine.runner.lora
        begin_step = lora_model.begin_step
        groups = []

        def recording(slots, query_lens):
            begin_step(slots, query_lens)
            batch = lora_model.context.batch
            if batch is not None:
                bundled = batch.bundle.num_slots if batch.bundle is not None else 0
                groups.append((batch.groups, bundled))

        lora_model.begin_step = recording
        _, got = generate(llm, prompts, loras, MAX_TOKENS)
    # the runner lays out each adapter's rows side by side: every group is one slice; with a
    # 16-token budget every adapter has few rows a step, so three go as one bundle
    assert any(bundled == 3 for _, bundled in groups)
    assert all(isinstance(rows, slice) for step, _ in groups for _, rows in step)
    assert got == expected(tiny_llama_dir, prompts, loras, MAX_TOKENS)


def test_prefix_cache_is_reused_within_an_adapter_never_across(tiny_llama_dir, llama_adapters):
    prompt = mixed_prompts(7, [26])[0]
    a, b = llama_adapters["attn4"], llama_adapters["all8"]
    with LLM(tiny_llama_dir, **LORA_FIELDS) as llm:
        stats = llm.engine.scheduler
        runs = []
        for lora in (a, b, None, a, None):
            hits_before = stats.prefix_cache_hits
            (out,), (tokens,) = generate(llm, [prompt], [lora], [6])
            runs.append((out.num_cached_tokens, stats.prefix_cache_hits - hits_before, tokens))
    full_blocks = (len(prompt) - 1) // 4 * 4
    # the first run under each of a, b and the base model finds nothing cached
    assert [r[:2] for r in runs[:3]] == [(0, 0)] * 3
    # a second run under a reuses a's blocks, and the base model's its own
    assert runs[3][:2] == (full_blocks, full_blocks)
    assert runs[4][:2] == (full_blocks, full_blocks)
    for (_, _, tokens), lora in zip(runs, (a, b, None, a, None)):
        assert tokens == peft_greedy(tiny_llama_dir, lora and lora.path, tuple(prompt), 6)


def test_preemption_with_adapters_matches_peft(tiny_llama_dir, llama_adapters):
    prompts, loras = mixed_batch(llama_adapters, seed=2)
    fields = LORA_FIELDS | {"num_kv_blocks": 24}  # the largest request needs 11 blocks
    with LLM(tiny_llama_dir, **fields) as llm:
        outs, got = generate(llm, prompts, loras, MAX_TOKENS)
    assert sum(o.num_preemptions for o in outs) > 0
    assert got == expected(tiny_llama_dir, prompts, loras, MAX_TOKENS)


def test_tensor_parallel_adapters_match_peft(tiny_llama_dir, llama_adapters):
    prompts, loras = mixed_batch(llama_adapters, seed=3)
    with LLM(tiny_llama_dir, **LORA_FIELDS, tensor_parallel_size=2) as llm:
        _, got = generate(llm, prompts, loras, MAX_TOKENS)
        # an adapter loaded after the group started reaches every rank too
        llm.remove_lora("all8")
        assert "all8" not in llm.list_loras()
        _, again = generate(llm, prompts[:4], loras[:4], MAX_TOKENS[:4])
    assert got == expected(tiny_llama_dir, prompts, loras, MAX_TOKENS)
    assert again == got[:4]


def _logits(engine: Engine, prompt: list[int], lora_name: str | None) -> torch.Tensor:
    runner = engine.runner
    slot = 0 if lora_name is None else runner.lora.slot_of[lora_name]
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    batch = StepBatch(prompt, [0], [len(prompt)], [blocks], list(range(len(prompt))), [], [slot])
    return runner.forward_batch(batch).float()


def test_adapter_on_int8_base_moves_logits_as_on_float_base(tiny_llama_dir, llama_adapters):
    """quantization="int8" has no peft reference (peft cannot run our int8 kernels): the
    adapter's effect on the logits, (with adapter - without) on the int8 base, must match
    its effect on the fp32 base within 5% of its size, while int8 itself moves the logits."""
    prompt = mixed_prompts(9, [19])[0]
    lora = llama_adapters["all8"]
    deltas, bases = {}, {}
    for quantization in ("none", "int8"):
        config = EngineConfig(model=str(tiny_llama_dir), **LORA_FIELDS, quantization=quantization)
        engine = Engine(config)
        try:
            engine.add_lora(lora.name, lora.path)
            if quantization == "int8":
                assert engine.runner.num_quantized_weights > 0
            bases[quantization] = _logits(engine, prompt, None)
            deltas[quantization] = _logits(engine, prompt, lora.name) - bases[quantization]
        finally:
            engine.shutdown()
    assert not torch.equal(bases["none"], bases["int8"])
    size = deltas["none"].norm()
    assert size > 1.0
    assert (deltas["int8"] - deltas["none"]).norm() < 0.05 * size


def test_fused_checkpoint_names_and_mistral_match_peft(tmp_path_factory, tiny_tokenizer_dir,
                                                       tiny_mistral_dir):  # fmt: skip
    """Phi-3's adapters target its fused qkv_proj and gate_up_proj (one A, B rows split over
    q/k/v and gate/up); Mistral's are Llama's names. Each beside the base model in a batch."""
    from replica.tiny_lora import build_tiny_adapter
    from replica.tiny_models_phi3_smollm3 import build_tiny_phi3

    phi3 = tmp_path_factory.mktemp("phi3")
    build_tiny_phi3(phi3, tiny_tokenizer_dir, 21, tie_word_embeddings=False)
    fused = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    for model_dir, targets in ((phi3, fused), (tiny_mistral_dir, ("q_proj", "up_proj"))):
        path = build_tiny_adapter(
            model_dir, tmp_path_factory.mktemp("adapter"), rank=4, target_modules=targets
        )
        lora = LoRARequest("fused", str(path))
        prompts = mixed_prompts(5, [13, 6, 21])
        loras = [lora, None, lora]
        with LLM(model_dir, **LORA_FIELDS) as llm:
            _, got = generate(llm, prompts, loras, [8, 8, 8])
        assert got == expected(model_dir, prompts, loras, [8, 8, 8])
        assert got[0] != expected(model_dir, prompts[:1], [None], [8])[0]  # it acted
