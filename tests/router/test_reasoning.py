"""Reasoning parsers (router/reasoning.py): thinking split from the answer, whole and streamed
with the tags split across deltas, and when a request thinks at all."""

from __future__ import annotations

import random

import pytest

from router.reasoning import Reasoning, request_reasoning

DEEPSEEK = Reasoning("deepseek_r1")
QWEN3 = Reasoning("qwen3")

# (reasoning, output, expected reasoning, expected content)
CASES = [
    (DEEPSEEK, "<think>\nplan it\n</think>\n\nThe answer.", "\nplan it\n", "The answer."),
    (DEEPSEEK, "plan it</think>The answer.", "plan it", "The answer."),  # opened in the prompt
    (DEEPSEEK, "still thinking <thi", "still thinking <thi", ""),  # no </think>: all reasoning
    (DEEPSEEK, "a < b </thin", "a < b </thin", ""),
    (QWEN3, '<think>step 1</think>\n\n{"a": 1}', "step 1", '{"a": 1}'),
    (QWEN3, "<think></think>Done.", "", "Done."),
    (QWEN3, "Direct answer, no thinking.", None, "Direct answer, no thinking."),
    (Reasoning("qwen3", opened=True), "thought</think>answer", "thought", "answer"),
]


@pytest.mark.parametrize("reasoning,text,thought,content", CASES)
def test_split_finished_text(reasoning, text, thought, content):
    assert reasoning.split(text) == (thought, content)


def test_qwen3_without_end_tag_is_all_content():
    """vLLM's qwen3 rule: a finished text with no </think> is all content."""
    assert QWEN3.split("<think>never closed") == (None, "<think>never closed")


@pytest.mark.parametrize("reasoning,text,thought,content", CASES)
def test_stream_split_anywhere_matches(reasoning, text, thought, content):
    rng = random.Random(3)
    splits = [[i] for i in range(1, len(text))]
    splits += [sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, 5))) for _ in range(20)]
    for cuts in splits:
        bounds = [0, *cuts, len(text)]
        stream = reasoning.stream()
        parts = []
        for a, b in zip(bounds, bounds[1:]):
            parts += stream.feed(text[a:b])
        parts += stream.finish()
        got_thought = "".join(t for k, t in parts if k == "reasoning")
        got_content = "".join(t for k, t in parts if k == "content")
        assert got_thought == (thought or ""), cuts
        assert got_content == content, cuts
        for _, t in parts:  # the tags never leak, whatever the split
            assert "<think>" not in t and "</think>" not in t


def test_stream_holds_only_a_possible_tag():
    stream = DEEPSEEK.stream()
    assert stream.feed("<think>abc</th") == [("reasoning", "abc")]
    assert stream.feed("ink>\n") == []
    assert stream.feed("done") == [("content", "done")]


@pytest.mark.parametrize(
    "parser,prompt,kwargs,expected",
    [
        ("none", "<|im_start|>assistant\n", None, None),
        ("qwen3", "<|im_start|>assistant\n", None, Reasoning("qwen3")),
        ("qwen3", "<|im_start|>assistant\n", {"enable_thinking": False}, None),
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None, None),
        ("deepseek_r1", "<｜Assistant｜><think>\n", None, Reasoning("deepseek_r1", opened=True)),
        ("deepseek_r1", "<｜Assistant｜>", {"thinking": False}, None),
    ],
)
def test_request_reasoning(parser, prompt, kwargs, expected):
    assert request_reasoning(parser, prompt, kwargs) == expected
