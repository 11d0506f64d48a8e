"""Tool calling in the Hermes format, where a call is a JSON object with "name" and
"arguments" between `<tool_call>` and `</tool_call>` in the generated text.

Prompt side: `render_messages` shapes OpenAI chat messages and tools for `apply_chat_template`,
either for a template that renders tools itself or, through `TOOL_SYSTEM_PROMPT`, for one that
only prints roles and contents. Output side: `parse_tool_calls` splits a finished text into
content and calls; `ToolCallStreamParser` does the same incrementally for streams."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

# the tags the output grammar of a required or named tool choice writes (one definition)
from replica.api import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from router.tool_parsers.base import (  # noqa: F401  (re-exported)
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallArgs,
    ToolCallStart,
    ToolCallsVoid,
    new_call_id,
)
from router.tool_parsers.hermes import (  # noqa: F401  (re-exported)
    ToolCallStreamParser,
    parse_tool_calls,
)

TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

# The tool block added to the system message when the chat template cannot render tools;
# "{tools}" is replaced by one JSON signature per line.
TOOL_SYSTEM_PROMPT = (
    "# Tools\n"
    "\n"
    "You may call one or more functions to help with the user's request. Their JSON "
    "signatures, one per line, are listed between <tools> and </tools>:\n"
    "<tools>\n"
    "{tools}\n"
    "</tools>\n"
    "\n"
    "To call a function, write a JSON object with its name and an object of arguments "
    "between <tool_call> and </tool_call>, one block per call:\n"
    "<tool_call>\n"
    '{"name": <function name>, "arguments": <arguments object>}\n'
    "</tool_call>\n"
    "The results come back between <tool_response> and </tool_response>."
)


# -- template detection ------------------------------------------------------------------------
def _template_source(chat_template: Any) -> str | None:
    """The template `apply_chat_template` uses when tools are passed: for named templates the
    "tool_use" one, else "default"."""
    if isinstance(chat_template, str):
        return chat_template
    if isinstance(chat_template, list):  # tokenizer_config.json form: [{"name", "template"}]
        chat_template = {
            t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)
        }
    if isinstance(chat_template, dict):
        for name in ("tool_use", "default"):
            if isinstance(chat_template.get(name), str):
                return chat_template[name]
    return None


_JINJA_TAG = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.DOTALL)
_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.DOTALL)
_TOOLS_NAME = re.compile(r"(?<![\w.])tools\b")


def _mentions_tools(source: str) -> bool:
    """Whether the Jinja variable `tools` appears in a template's expressions and statements
    (string literals and plain text aside)."""
    try:
        import jinja2
        import jinja2.meta
    except ImportError:
        jinja2 = None
    if jinja2 is not None:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"])
        try:
            return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateSyntaxError:
            pass  # a custom tag (e.g. HF's {% generation %}): scan the tags instead
    for tag in _JINJA_TAG.findall(source):
        if _TOOLS_NAME.search(_STRING_LITERAL.sub("''", tag)):
            return True
    return False


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads the `tools` variable."""
    source = _template_source(getattr(tokenizer, "chat_template", None))
    return bool(source) and _mentions_tools(source)


# -- prompt side -------------------------------------------------------------------------------
def _text(content: Any) -> str:
    """Message content as a plain string (None -> "", text parts joined by newlines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p.get("text", "") if isinstance(p, dict) else str(getattr(p, "text", p))
            for p in content
        )
    return str(content)


def _loads_arguments(arguments: Any) -> Any:
    """Arguments as a JSON value: a JSON string is parsed ("" -> {}), anything else kept."""
    if not isinstance(arguments, str):
        return {} if arguments is None else arguments
    if not arguments.strip():
        return {}
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def format_tool_call(name: str, arguments: dict | str) -> str:
    """The Hermes text of one call: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`.
    A string of arguments is embedded as the JSON it holds (as a string if it is not JSON)."""
    body = json.dumps({"name": name, "arguments": _loads_arguments(arguments)}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def _function_of(tool: dict) -> dict:
    """The function object of an OpenAI tool, None-valued keys dropped."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else {}
    return {k: v for k, v in fn.items() if v is not None}


def tool_system_prompt(tools: Iterable[dict]) -> str:
    """`TOOL_SYSTEM_PROMPT` with the signatures (name, description, parameters) of `tools`."""
    lines = []
    for tool in tools:
        fn = _function_of(tool)
        sig = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
        lines.append(json.dumps(sig, ensure_ascii=False))
    return TOOL_SYSTEM_PROMPT.replace("{tools}", "\n".join(lines))


def _call_parts(call: dict) -> tuple[str, Any]:
    fn = call.get("function") or {}
    return fn.get("name", ""), fn.get("arguments")


def _render_native(messages: list[dict]) -> list[dict]:
    out = []
    for msg in messages:
        m = dict(msg)
        m["content"] = _text(msg.get("content"))
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            calls = []
            for call in msg["tool_calls"]:
                name, arguments = _call_parts(call)
                parsed = _loads_arguments(arguments)
                c = dict(call)
                c["type"] = call.get("type") or "function"
                c["function"] = {
                    "name": name,
                    "arguments": parsed if isinstance(parsed, dict) else arguments,
                }
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out


def _render_inline(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    in_tool_run = False  # the last output message holds tool responses
    for msg in messages:
        role = msg.get("role")
        content = _text(msg.get("content"))
        if role == "tool":
            response = f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"
            if in_tool_run:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
                in_tool_run = True
            continue
        in_tool_run = False
        m = {k: v for k, v in msg.items() if k not in ("tool_calls", "tool_call_id")}
        if role == "assistant" and msg.get("tool_calls"):
            parts = [content] if content else []
            parts += [format_tool_call(*_call_parts(c)) for c in msg["tool_calls"]]
            content = "\n".join(parts)
        m["content"] = content
        out.append(m)
    return out


def render_messages(
    messages: list[dict], tools: list[dict] | None, template_tools: bool
) -> tuple[list[dict], list[dict] | None]:
    """Messages and the `tools` argument for `apply_chat_template`.

    With `template_tools` the template renders tools, calls (arguments parsed into objects)
    and tool messages itself. Without, tools go into the system message (`TOOL_SYSTEM_PROMPT`),
    calls become Hermes text in the assistant content and tool results become user messages
    in <tool_response> tags. Every returned message has string content."""
    if template_tools:
        native = [{"type": "function", "function": _function_of(t)} for t in tools or []]
        return _render_native(messages), native or None
    out = _render_inline(messages)
    if tools:
        block = tool_system_prompt(tools)
        if out and out[0].get("role") == "system":
            system = out[0]["content"]
            out[0] = {**out[0], "content": f"{system}\n\n{block}" if system else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None
