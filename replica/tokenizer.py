"""The checkpoint's tokenizer, for the engine and the ingress.

transformers' AutoTokenizer builds the model's config class to choose the tokenizer class, and
importing a config class imports torch and more (~3 s of a replica's start, on a 2-core host,
and the ingress needs torch for nothing else). For the checkpoints whose tokenizer_config.json
declares the generic tokenizers-backed class, with a model type whose tokenizer AutoTokenizer
does not special-case (FAST_MODEL_TYPES), that class is loaded directly: the class
AutoTokenizer would choose (tests/test_loader.py compares them). Anything else goes through
AutoTokenizer."""

from __future__ import annotations

import json
from pathlib import Path

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
FAST_MODEL_TYPES = frozenset({"llama"})  # qwen2: AutoTokenizer picks Qwen2Tokenizer


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def generic_tokenizer_class(model_dir: str | Path) -> str | None:
    """The generic class to load directly, or None when AutoTokenizer must choose."""
    path = Path(model_dir)
    tokenizer_config = _read_json(path / "tokenizer_config.json")
    declared = tokenizer_config.get("tokenizer_class")
    model_type = _read_json(path / "config.json").get("model_type")
    if (
        declared in GENERIC_CLASSES
        and "auto_map" not in tokenizer_config
        and model_type in FAST_MODEL_TYPES
        and (path / "tokenizer.json").is_file()
    ):
        return declared
    return None


def load_tokenizer(model_dir: str | Path):
    import transformers

    declared = generic_tokenizer_class(model_dir)
    if declared is not None:
        return getattr(transformers, declared).from_pretrained(str(model_dir))
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))
