"""A LoRA adapter over quantized GGUF weights: the adapter's float product is added to the
quantized matmul's output, so with fp32 activations the engine matches transformers + peft on
the same de-quantized file token for token, in one batch with the base model."""

from __future__ import annotations

import pytest
import torch

from replica.config import EngineConfig
from replica.lora.peft import read_adapter
from replica.request import EngineRequest, LoRARequest, Request
from replica.runner import ModelRunner
from replica.scheduler import Scheduler
from replica.tiny_lora import ALL_LINEAR_MODULES
from tests.replica.quant_helpers import gguf_path, tiny_gguf_dir
from tests.replica.test_model_parity import greedy_params
from tests.replica.test_quant_engine import prompts_of


def gguf_peft_model(sidecar, rank: int, seed: int):
    """transformers' fp32 model of the GGUF with a random peft adapter on every linear."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = gguf_path(sidecar)
    base = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(ALL_LINEAR_MODULES),
        lora_dropout=0.0, init_lora_weights=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.1)
    return model.eval()


def peft_greedy(model, prompt: list[int], max_new_tokens: int, adapter: bool) -> list[int]:
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    with torch.no_grad():
        if adapter:
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        else:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama"])
def test_an_adapter_over_gguf_weights_matches_peft_on_the_dequantized_file(arch, tmp_path):
    sidecar = tiny_gguf_dir(arch)
    model = gguf_peft_model(sidecar, rank=4, seed=3)
    model.save_pretrained(tmp_path / "adapter", safe_serialization=True)
    lora = LoRARequest("gguf-all4", str(tmp_path / "adapter"))
    prompts = prompts_of(7, [5, 19, 33, 12])
    max_tokens = [10, 8, 12, 9]
    loras = [lora, None, lora, None]
    config = EngineConfig(
        model=str(sidecar), device="cpu", enable_lora=True, quant_activations="fp32",
        block_size=4, num_kv_blocks=256,
    )  # fmt: skip
    runner = ModelRunner(config, sidecar)  # the scheduler and runner alone: no tokenizer
    runner.add_lora(1, read_adapter(lora.name, lora.path, runner.lora_targets, 16), lora.name)
    scheduler = Scheduler(config, 256, runner.max_model_len)
    requests = [
        Request(EngineRequest(p, greedy_params(n), f"r{i}", lora=lo))
        for i, (p, n, lo) in enumerate(zip(prompts, max_tokens, loras))
    ]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished():
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute(so).sampled)
    got = [r.output_token_ids for r in requests]
    expected = [
        peft_greedy(model, p, n, adapter=lo is not None)
        for p, n, lo in zip(prompts, max_tokens, loras)
    ]
    assert got == expected
    assert got[0] != peft_greedy(model, prompts[0], max_tokens[0], adapter=False)
