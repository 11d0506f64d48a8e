"""Random LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors) for
a local checkpoint, made with peft itself: the adapters the LoRA tests, HTTP tests and benches
load, where no hub can be reached. Needs `peft`."""

from __future__ import annotations

from pathlib import Path

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR_MODULES = (*ATTENTION_MODULES, "gate_proj", "up_proj", "down_proj")


def build_tiny_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float | None = None,
    target_modules: tuple[str, ...] = ATTENTION_MODULES,
    seed: int = 0,
    scale: float = 0.1,
) -> Path:
    """A random adapter of `rank` on `target_modules` of the checkpoint at `model_dir`, saved
    to `out_dir`. Both A and B are drawn (PEFT's own init leaves B zero, an adapter that
    changes nothing), with normals of `scale`: enough that greedy outputs differ from the base
    model's, so a test that drops or mixes up adapters fails."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=False,
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.normal_(0.0, scale)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out
