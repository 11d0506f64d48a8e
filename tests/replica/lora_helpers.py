"""Adapters for the LoRA tests (made with peft by replica/tiny_lora.py) and peft's greedy
output with an adapter applied: the reference our engine must match token for token."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import torch

from replica.request import LoRARequest
from replica.tiny_lora import ALL_LINEAR_MODULES, ATTENTION_MODULES, build_tiny_adapter

# name -> (rank, target modules, seed, use_rslora): ranks and targets differ on purpose
ADAPTERS = {
    "attn4": (4, ATTENTION_MODULES, 11, False),
    "all8": (8, ALL_LINEAR_MODULES, 12, False),
    "qv2-rs": (2, ("q_proj", "v_proj", "down_proj"), 13, True),
}


def make_adapters(model_dir: Path, root: Path) -> dict[str, LoRARequest]:
    """The ADAPTERS for `model_dir` under `root`, as LoRARequests by name."""
    out = {}
    for name, (rank, targets, seed, rslora) in ADAPTERS.items():
        path = root / name
        build_tiny_adapter(model_dir, path, rank=rank, target_modules=targets, seed=seed)
        if rslora:  # scaling alpha / sqrt(r): peft reads the flag back from the config
            config_path = path / "adapter_config.json"
            config = json.loads(config_path.read_text())
            config["use_rslora"] = True
            config_path.write_text(json.dumps(config))
        out[name] = LoRARequest(name, str(path))
    return out


def edit_adapter(source: str | Path, out: Path, **config_fields) -> Path:
    """A copy of an adapter with fields of its adapter_config.json replaced."""
    shutil.copytree(source, out)
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(config_fields)
    config_path.write_text(json.dumps(config))
    return out


@functools.cache
def _peft_model(model_dir: Path, adapter_path: str | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    )
    if adapter_path is None:
        return base.eval()
    return PeftModel.from_pretrained(base, adapter_path).eval()


@functools.cache
def peft_greedy(
    model_dir: Path, adapter_path: str | None, prompt: tuple[int, ...], max_new_tokens: int
) -> list[int]:
    """transformers + peft greedy continuation of one prompt (fp32, eager, no EOS stop)."""
    model = _peft_model(model_dir, adapter_path)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def expected(model_dir: Path, prompts, loras, max_tokens) -> list[list[int]]:
    return [
        peft_greedy(model_dir, None if lora is None else lora.path, tuple(p), n)
        for p, lora, n in zip(prompts, loras, max_tokens, strict=True)
    ]
