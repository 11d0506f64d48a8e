"""Models the benchmarks run: the tests' tiny random Llama (built once into the stepserve cache,
with a longer context than the tests use) or the converted default model."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# A bigger sibling of the tests' tiny Llama: enough compute per token that batch size and
# prompt length show up in step times, still far cheaper than the 135M default model.
TINY_FIELDS = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
_TINY_NAME = "bench-tiny-llama-v1"
_DONE_MARKER = ".stepserve-bench-built"


def tiny_model_dir() -> Path:
    """The benchmark's tiny random Llama (vocab 512), built on first use into the cache."""
    from replica.default_model import cache_root
    from replica.tiny_models import build_tiny_model, build_tiny_tokenizer

    target = cache_root() / _TINY_NAME
    if (target / _DONE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{_TINY_NAME}-", dir=target.parent) as tmp:
        tok_dir, model_dir = Path(tmp) / "tokenizer", Path(tmp) / "model"
        tok_dir.mkdir()
        model_dir.mkdir()
        build_tiny_tokenizer(tok_dir)
        build_tiny_model(model_dir, tok_dir, "llama", seed=11, **TINY_FIELDS)
        (model_dir / _DONE_MARKER).write_text("built\n")
        model_dir.chmod(0o755)
        if not (target / _DONE_MARKER).exists():
            shutil.rmtree(target, ignore_errors=True)
            model_dir.rename(target)
    return target


def model_dir(name: str) -> Path:
    """`tiny`, `default` (SmolLM2-135M-Instruct) or a path to a local HF directory."""
    if name == "tiny":
        return tiny_model_dir()
    if name == "default":
        from replica.default_model import default_model_dir

        return default_model_dir()
    path = Path(name)
    if not path.is_dir():
        raise SystemExit(f"--model {name!r}: expected tiny, default or a model directory")
    return path
