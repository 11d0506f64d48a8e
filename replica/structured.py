"""Structured outputs: a `StructuredOutput` spec (replica/request.py) compiled into a token-level
grammar with xgrammar, the grammar engine vLLM and SGLang use, and one matcher per constrained
request that yields the step's allowed-token bitmask and is fed every sampled token.

Only constrained requests pay: the runner fills bitmask rows for the requests that hold a
`GrammarState` and the sampler masks those rows alone. Compiled grammars are cached by spec
(xgrammar's compiler caches them per spec text too). A spec that cannot compile is rejected by
the replica (GrammarRejected, a 400 the ingress names and remembers); the ingress does not
import xgrammar.

A reasoning model's request carries the tokens that end its thinking (StructuredOutput.after):
its GrammarState leaves the output free until they are sampled (no mask row is filled), then
constrains the rest; a migrated request's replay goes through the same gate.

JSON is generated compactly (no free whitespace between tokens: small models given free
whitespace can loop on it until max_tokens); tool calls are written in the syntax of the
model's tool-call family (`tool_call_tag`; router/tool_parsers/ parses them).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from replica.request import StructuredOutput

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["GrammarState", "StructuredOutputError", "StructuredOutputs", "check", "tool_call_tag"]

# the Hermes tool-call tags (router/tool_calls.py parses and renders with these) and the
# layout of one call, split where the function name and its arguments go
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_CALL_BEGIN = TOOL_CALL_OPEN + '\n{"name": "'
TOOL_CALL_ARGUMENTS = '", "arguments": '
TOOL_CALL_END = "}\n" + TOOL_CALL_CLOSE

_CACHE_SIZE = 256
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class StructuredOutputError(ValueError):
    """The spec cannot be compiled into a grammar (a user error: HTTP 400)."""


_LOADED = threading.Event()  # xgrammar imported in this process


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise StructuredOutputError(
            "structured outputs need the xgrammar package (pip install xgrammar)"
        ) from exc
    _LOADED.set()
    return xgrammar


def grammar_engine_loaded() -> bool:
    """Whether this process has imported the grammar engine."""
    return _LOADED.is_set()


def _clean(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)


# xgrammar 0.2.9 writes a length-bounded JSON string's characters (maxLength, minLength) as
# [^"\\\r\n], which lets control characters through, and JSON forbids them raw in strings
# (an output then fails json.loads); and its UTF-8 matching lets the encodings of surrogates
# (U+D800-U+DFFF, invalid in UTF-8) through, which decode to three U+FFFD each and so break
# maxLength. Such grammars are re-read with the class JSON strings allow.
_STRING_CHAR_CLASSES = ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]')
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]'


def _strict_strings(xgr, grammar):
    text = str(grammar)
    fixed = text
    for loose in _STRING_CHAR_CLASSES:
        fixed = fixed.replace(loose, _JSON_STRING_CHAR)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


def _json_schema_grammar(xgr, schema: Any):
    text = schema if isinstance(schema, str) else json.dumps(schema)
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    return _strict_strings(xgr, grammar)


def _call_tag(fmt: str, tool: dict) -> dict:
    """One call of `tool` ({"name", "parameters"}) in a family's syntax, as a structural tag."""
    name, schema = tool["name"], tool.get("parameters") or {"type": "object"}
    json_args = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    if fmt == "hermes":
        return {
            "type": "tag",
            "begin": TOOL_CALL_BEGIN + name + TOOL_CALL_ARGUMENTS,
            "content": json_args,
            "end": TOOL_CALL_END,
        }
    if fmt == "llama3_json":
        begin = '{"name": "' + name + '", "parameters": '
        return {"type": "tag", "begin": begin, "content": json_args, "end": "}"}
    if fmt == "mistral":
        begin = '{"name": "' + name + '", "arguments": '
        return {"type": "tag", "begin": begin, "content": json_args, "end": "}"}
    if fmt == "qwen3_coder":
        return {
            "type": "tag",
            "begin": f"<tool_call>\n<function={name}>\n",
            "content": {
                "type": "json_schema",
                "json_schema": schema,
                "style": "qwen_xml",
                "max_whitespace_cnt": 1,
            },
            "end": "\n</function>\n</tool_call>",
        }
    if fmt == "pythonic":
        return {"type": "tag", "begin": name + "(", "content": _pythonic_args(schema), "end": ")"}
    raise StructuredOutputError(f"unknown tool call format {fmt!r}")


def _pythonic_args(schema: dict) -> dict:
    """Keyword arguments `k=v, ...` for an object schema: each property's value in JSON syntax
    under its own schema (the pythonic parser reads JSON's true/false/null too), required
    properties in the schema's order, then optional ones in order. Not enforced: properties
    the schema does not list (additionalProperties), and optional properties out of order."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict) or not props:
        return {"type": "const_string", "value": ""}
    required = [k for k in props if k in set(schema.get("required") or [])]
    optional = [k for k in props if k not in required]

    def arg(key: str, sep: str) -> dict:
        value = props[key] if isinstance(props[key], dict) else {}
        return {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": f"{sep}{key}="},
                {"type": "json_schema", "json_schema": value, "max_whitespace_cnt": 1},
            ],
        }

    if required:
        elements = [arg(k, ", " if i else "") for i, k in enumerate(required)]
        elements += [{"type": "optional", "content": arg(k, ", ")} for k in optional]
        return {"type": "sequence", "elements": elements}
    # no required property: nothing, or a first property then any later ones in order
    starts = [{"type": "const_string", "value": ""}]
    for i, key in enumerate(optional):
        later = [{"type": "optional", "content": arg(k, ", ")} for k in optional[i + 1 :]]
        starts.append({"type": "sequence", "elements": [arg(key, "")] + later})
    return {"type": "or", "elements": starts}


# per family: (text before the calls, separator, text after) of required/named calls, and the
# trigger that opens a call in free text (auto)
_CALL_LISTS = {
    "hermes": ("", "\n", "", TOOL_CALL_OPEN),
    "llama3_json": ("", "; ", "", '{"name": '),
    "mistral": ("[TOOL_CALLS][", ", ", "]", "[TOOL_CALLS]"),
    "qwen3_coder": ("", "\n", "", "<tool_call>\n<function="),
    "pythonic": ("[", ", ", "]", "["),
}


def tool_call_tag(tools: list[dict], mode: str, parallel: bool, fmt: str = "hermes") -> dict:
    """The xgrammar structural tag (as JSON) for tool calls in the family `fmt`'s syntax.
    `tools`: [{"name", "parameters"}]. mode "named": exactly the one tool; "required": one
    or more calls (one if not `parallel`) and nothing else; "auto": free text in which every
    call the family's trigger opens must be a valid call of one of the tools (mistral and
    pythonic: one call per trigger)."""
    if fmt not in _CALL_LISTS:
        raise StructuredOutputError(
            f"tool call format must be one of {sorted(_CALL_LISTS)}, got {fmt!r}"
        )
    tags = [_call_tag(fmt, tool) for tool in tools]
    if not tags:
        raise StructuredOutputError("tool calls need at least one tool")
    before, separator, after, trigger = _CALL_LISTS[fmt]
    if mode == "named":
        if len(tags) != 1:
            raise StructuredOutputError(f"a named tool choice takes one tool, got {len(tags)}")
        calls: dict = tags[0]
    elif mode == "required":
        calls = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": separator,
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
    elif mode == "auto":
        if before or after:  # the list opens with the trigger: one call per list
            tags = [{**t, "begin": before + t["begin"], "end": t["end"] + after} for t in tags]
        fmt_tag = {
            "type": "triggered_tags",
            "triggers": [trigger],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        }
        return {"type": "structural_tag", "format": fmt_tag}
    else:
        raise StructuredOutputError(f"tool call mode must be named, required or auto: {mode!r}")
    if before or after:
        calls = {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": before},
                calls,
                {"type": "const_string", "value": after},
            ],
        }
    return {"type": "structural_tag", "format": calls}


def build_grammar(spec: StructuredOutput):
    """The xgrammar Grammar of a spec (no tokenizer needed); StructuredOutputError names the
    problem when it cannot be built."""
    xgr = _xgrammar()
    kind, text = spec.kind, spec.spec
    try:
        if kind == "json":
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as exc:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise StructuredOutputError(
                    f"a JSON schema must be an object, got {type(schema).__name__}"
                )
            return _json_schema_grammar(xgr, schema if schema is not True else {})
        if kind == "json_object":
            return _json_schema_grammar(xgr, {"type": "object"})
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
            alternatives = " | ".join(json.dumps(c) for c in choices)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
        if kind == "structural_tag":
            return _strict_strings(xgr, xgr.Grammar.from_structural_tag(text))
        if kind == "tool_calls":
            plan = json.loads(text)
            tag = tool_call_tag(
                plan["tools"],
                plan["mode"],
                plan.get("parallel", True),
                plan.get("format", "hermes"),
            )
            return _strict_strings(xgr, xgr.Grammar.from_structural_tag(json.dumps(tag)))
    except StructuredOutputError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the reason
        raise StructuredOutputError(
            f"cannot compile the {kind} constraint: {_clean(exc)}"
        ) from None
    raise StructuredOutputError(f"unknown structured output kind {kind!r}")


def check(spec: StructuredOutput) -> None:
    """Raise StructuredOutputError if the spec cannot become a grammar."""
    build_grammar(spec)


class GrammarState:
    """One constrained request's matcher: fills its bitmask row, accepts sampled tokens.

    With a `gate` (StructuredOutput.after: the tokens that end a reasoning model's thinking)
    every token passes, unmasked, until the output has sampled the gate's sequence; the
    matcher sees the tokens after it."""

    __slots__ = ("matcher", "gate", "matched")

    def __init__(self, matcher, gate: tuple[int, ...] = ()) -> None:
        self.matcher = matcher
        self.gate = gate
        self.matched = 0  # gate tokens matched so far (len(gate): open)

    @property
    def gated(self) -> bool:
        """Still before the gate's sequence: nothing is constrained yet."""
        return self.matched < len(self.gate)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matched >= len(self.gate):
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it (the request
        then ends: its output could not match)."""
        if self.matched < len(self.gate):
            gate = self.gate
            if token_id == gate[self.matched]:
                self.matched += 1
            else:  # restart: the longest gate prefix that ends with this token
                self.matched = next(
                    (
                        n
                        for n in range(self.matched, 0, -1)
                        if gate[n - 1] == token_id
                        and gate[: n - 1] == gate[self.matched - n + 1 : self.matched]
                    ),
                    0,
                )
            return True
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self.matched >= len(self.gate) and self.matcher.is_terminated()


class StructuredOutputs:
    """One engine's grammar compiler (for its tokenizer and vocabulary) and compiled-grammar
    cache. Thread-safe: the async engine compiles off the engine thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer  # or a LazyTokenizer, loaded at the first compilation
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self.num_compiled = 0  # compilations done (cache misses)

    def _get_compiler(self):
        if self._compiler is None:
            xgr = _xgrammar()
            from replica.tokenizer import loaded

            info = xgr.TokenizerInfo.from_huggingface(
                loaded(self.tokenizer),
                vocab_size=self.vocab_size,
                stop_token_ids=self.eos_token_ids or None,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def prepare(self) -> None:
        """Import the grammar engine and build the compiler's view of the vocabulary now
        (~0.5 s for a 49k-token vocabulary, most of it holding the GIL), not at the first
        constrained request."""
        with self._lock:
            self._get_compiler()

    @property
    def prepared(self) -> bool:
        return self._compiler is not None

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of a spec, from the cache when seen before."""
        if spec.after:  # the gate is the matcher's, not the grammar's
            spec = StructuredOutput(spec.kind, spec.spec)
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
            compiler = self._get_compiler()
        grammar = build_grammar(spec)
        try:
            compiled = compiler.compile_grammar(grammar)
        except Exception as exc:
            raise StructuredOutputError(
                f"cannot compile the {spec.kind} constraint: {_clean(exc)}"
            ) from None
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, spec: StructuredOutput, compiled=None) -> GrammarState:
        """A fresh matcher for one request (compiling the spec unless `compiled` is given)."""
        xgr = _xgrammar()
        return GrammarState(xgr.GrammarMatcher(compiled or self.compile(spec)), spec.after)


def fill_bitmask(
    states: list[GrammarState],
    vocab_size: int,
    out: torch.Tensor | None = None,
    rows: list[int] | None = None,
) -> torch.Tensor:
    """The packed allowed-token bitmask int32 of the given matchers (ceil(V/32) words a row):
    a fresh [len(states), words] tensor, or written into the reused `out` at `rows` (one row
    per state; each row is overwritten whole) and `out` returned."""
    import torch  # here, not at the top: the ingress imports this module without torch

    if out is None:
        out = torch.full((len(states), (vocab_size + 31) // 32), -1, dtype=torch.int32)
        rows = range(len(states))
    for row, state in zip(rows, states, strict=True):
        if state.gated:  # nothing constrained yet: every token allowed
            out[row] = -1
        else:
            state.matcher.fill_next_token_bitmask(out, row)
    return out
