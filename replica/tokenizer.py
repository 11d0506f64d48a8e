"""The checkpoint's tokenizer, for the engine and the ingress.

transformers' AutoTokenizer builds the model's config class to choose the tokenizer class, and
importing a config class imports torch and more (~3 s of a replica's start, on a 2-core host,
and the ingress needs torch for nothing else). For the checkpoints whose tokenizer_config.json
declares the generic tokenizers-backed class, with a model type whose tokenizer AutoTokenizer
does not special-case (FAST_MODEL_TYPES), that class is loaded directly: the class
AutoTokenizer would choose (tests/replica/test_loader.py compares them). Anything else goes through
AutoTokenizer."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
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


def declared_eos_token_id(model_dir: str | Path) -> int | None:
    """The id of the eos_token that tokenizer_config.json declares, looked up in tokenizer.json
    (its added tokens, then its vocabulary) without loading a tokenizer: what the loaded
    tokenizer's `eos_token_id` is (tests/replica/test_loader.py compares), at a fraction of the cost
    (an engine core that does not detokenize needs no more of its tokenizer at start).
    LookupError when the files do not settle it (the tokenizer must be loaded to know)."""
    path = Path(model_dir)
    config = _read_json(path / "tokenizer_config.json")
    if "eos_token" not in config:
        raise LookupError("tokenizer_config.json declares no eos_token")
    eos = _token_content(config["eos_token"])
    mapped = _read_json(path / "special_tokens_map.json")
    if "eos_token" in mapped and _token_content(mapped["eos_token"]) != eos:
        raise LookupError("special_tokens_map.json declares another eos_token")
    if eos is None:
        return None
    spec = _read_json(path / "tokenizer.json")
    for added in spec.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == eos:
            return int(added["id"])
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and eos in vocab:
        return int(vocab[eos])
    raise LookupError(f"eos_token {eos!r} is not in tokenizer.json")


def _token_content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


class LazyTokenizer:
    """A checkpoint's tokenizer, loaded on the first `get()` (thread-safe). `resolve`: the
    model is a path as the user gave it (EngineConfig.model; None the default model), resolved
    by the load (replica.default_model.resolve_model: a GGUF file's metadata directory)."""

    def __init__(self, model_dir: str | Path | None, resolve: bool = False) -> None:
        self.model_dir = model_dir
        self.resolve = resolve
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def get(self):
        with self._lock:
            if self._tokenizer is None:
                model_dir = self.model_dir
                if self.resolve:
                    from replica.default_model import resolve_model

                    model_dir = resolve_model(model_dir)
                self._tokenizer = load_tokenizer(model_dir)
            return self._tokenizer

    async def wait(self):
        """`get()` for an event loop: the tokenizer, waiting for its load in a worker thread
        (not on the loop) while it is still loading."""
        if self.loaded:
            return self._tokenizer
        import asyncio

        return await asyncio.to_thread(self.get)

    def preload(self, then: Callable[[], None] | None = None) -> LazyTokenizer:
        """Start loading now, in a thread of its own; `get()` waits for it. A load that fails
        there is tried again, and its error raised, by the next `get()`; one that succeeds
        calls `then` (a serving process freezes its heap: replica/startup.py)."""

        def load() -> None:
            try:
                self.get()
            except Exception:  # said by the get() that needs it
                return
            if then is not None:
                then()

        threading.Thread(target=load, name="tokenizer-load", daemon=True).start()
        return self


def loaded(tokenizer):
    """The tokenizer itself: a LazyTokenizer's, loaded now if it was not yet."""
    return tokenizer.get() if isinstance(tokenizer, LazyTokenizer) else tokenizer
