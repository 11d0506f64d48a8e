"""Reasoning parsers (EngineConfig.reasoning_parser, vLLM's names): split a reasoning model's
output into its thinking (`reasoning_content`) and its answer (`content`), whole or as it
streams, with the `<think>` tags never in either.

deepseek_r1: the output starts in thinking (its template opens `<think>` in the prompt, or the
model writes it); text up to `</think>` is reasoning, the rest content; without `</think>` all
of it is reasoning. qwen3: `<think>...</think>` at the start is reasoning; a finished text
without `</think>` is all content (a stream has sent what came after `<think>` as reasoning by
then). Thinking is off for a request whose chat_template_kwargs say enable_thinking (or
thinking) false, or whose prompt already closes it (ends with `</think>`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(frozen=True)
class Reasoning:
    """A request's thinking, as its prompt leaves it: the parser's name, and whether the
    prompt itself opened `<think>` (so the output starts inside it)."""

    parser: str
    opened: bool = False

    @property
    def starts_thinking(self) -> bool:
        """Output without a leading `<think>` is thinking (deepseek_r1, or opened)."""
        return self.parser == "deepseek_r1" or self.opened

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a finished text; reasoning None when there was none."""
        if self.parser == "qwen3" and THINK_END not in text:
            return None, text
        stream = self.stream()
        parts = stream.feed(text) + stream.finish()
        reasoning = "".join(t for kind, t in parts if kind == "reasoning")
        content = "".join(t for kind, t in parts if kind == "content")
        return (reasoning if stream.thought else None), content


def request_reasoning(
    parser: str, prompt_text: str, template_kwargs: dict[str, Any] | None
) -> Reasoning | None:
    """The request's Reasoning, None when it does not think (parser none, thinking turned
    off by the template kwargs, or closed in the prompt)."""
    if parser == "none":
        return None
    kwargs = template_kwargs or {}
    if kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False:
        return None
    tail = prompt_text.rstrip()
    if tail.endswith(THINK_END):
        return None
    return Reasoning(parser, opened=tail.endswith(THINK_START))


class ReasoningStream:
    """Incremental split: `feed` text deltas, `finish`; each returns [(kind, text)] with kind
    "reasoning" or "content". A possible tag prefix at a delta's end is held back."""

    def __init__(self, reasoning: Reasoning) -> None:
        self.reasoning = reasoning
        self.mode = "start"  # start (is `<think>` coming?) | reasoning | after (strip ws) | content
        self.held = ""
        self.thought = False  # any reasoning text or tag seen

    @property
    def in_content(self) -> bool:
        return self.mode in ("after", "content")

    def feed(self, delta: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.held += delta
        while True:
            text = self.held
            if self.mode == "start":
                body = text.lstrip()
                if body.startswith(THINK_START):
                    self.held = body[len(THINK_START) :]
                    self.mode, self.thought = "reasoning", True
                    continue
                if THINK_START.startswith(body):
                    return out  # empty or a prefix of the tag: wait
                self.mode = "reasoning" if self.reasoning.starts_thinking else "content"
                self.thought = self.mode == "reasoning"
                continue
            if self.mode == "reasoning":
                end = text.find(THINK_END)
                if end >= 0:
                    if end:
                        out.append(("reasoning", text[:end]))
                    self.held = text[end + len(THINK_END) :]
                    self.mode = "after"
                    continue
                cut = len(text) - _held(text, THINK_END)
                if cut:
                    out.append(("reasoning", text[:cut]))
                self.held = text[cut:]
                return out
            if self.mode == "after":
                body = text.lstrip()
                if not body:
                    self.held = ""
                    return out
                self.held, self.mode = body, "content"
                continue
            if text:
                out.append(("content", text))
            self.held = ""
            return out

    def finish(self) -> list[tuple[str, str]]:
        """What is held: a partial tag goes out as the text it was."""
        out: list[tuple[str, str]] = []
        text, self.held = self.held, ""
        if not text:
            return out
        if self.mode == "start":
            kind = "reasoning" if self.reasoning.starts_thinking else "content"
            self.thought = self.thought or kind == "reasoning"
            out.append((kind, text))
        elif self.mode == "reasoning":
            out.append(("reasoning", text))
        elif self.mode == "content":
            out.append(("content", text))
        return out
