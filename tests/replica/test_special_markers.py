"""Tool-call and reasoning markers that are special tokens (Mistral's `[TOOL_CALLS]`, Llama's
`<|python_tag|>`, a `<think>` tag), in the engine (no Ray) on a tiny tokenizer where they are:
the ingress keeps special tokens for the requests that need them (skip_special_tokens false),
the detokenizer then writes the markers and leaves the stop token out, and the chat answer,
whole and streamed, parses as it should; skipping them (the default) loses the call."""

from __future__ import annotations

import json

import pytest

from replica.engine import LLM
from replica.request import EngineRequest, Resume, SamplingParams, StructuredOutput
from router.dialects import ChatDialect
from router.protocol import ChatCompletionRequest
from router.reasoning import Reasoning
from router.served_model import special_markers
from router.tool_parsers import get_tool_parser
from tests.parser_models import build_family_models

PING = {
    "name": "ping",
    "parameters": {
        "type": "object",
        "properties": {"loud": {"type": "boolean"}},
        "required": ["loud"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": PING}]


@pytest.fixture(scope="module")
def family_dirs(tiny_tokenizer_dir, tmp_path_factory):
    return build_family_models(
        tiny_tokenizer_dir, tmp_path_factory.mktemp("special-families"), special=True
    )


@pytest.fixture(scope="module")
def llm(family_dirs):
    engine = LLM(
        model=str(family_dirs["mistral"]),
        max_model_len=1024,
        num_kv_blocks=256,
        block_size=16,
        max_num_batched_tokens=256,
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tokenizer(family_dirs):
    """The families' (shared) tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(family_dirs["mistral"]))


def chat_request(
    tokenizer, family: str, tool_choice="auto", reasoning=None
) -> ChatCompletionRequest:
    """A chat request as the ingress leaves it for a model of this tokenizer and family."""
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "ping?"}], tools=TOOLS, tool_choice=tool_choice
    )
    markers = special_markers(tokenizer, get_tool_parser(family), "deepseek_r1")
    req.use_model_format(family, reasoning, (), markers)
    return req


def prompt_of(llm, family_dirs, family: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(family_dirs[family]))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "ping?"}],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=False,
    )
    return tok.encode(text, add_special_tokens=False)


def run(llm, request: EngineRequest):
    engine = llm.engine
    engine.check_request(request)
    engine.add(request)
    deltas = []
    while not (deltas and deltas[-1].finished):
        deltas += [o for o in engine.step() if o.request_id == request.request_id]
    return deltas


def answers(llm, req: ChatCompletionRequest, family: str, deltas, tool_mode: str):
    """(whole message, streamed message) of the engine's deltas, through the chat dialect."""
    dialect = ChatDialect(llm.tokenizer, "m", get_tool_parser(family))
    text = "".join(d.new_text for d in deltas)
    whole, _ = dialect.message(text, tool_mode, req)
    stream = dialect.stream(tool_mode=tool_mode, chat=req)
    content, reasoning, calls = "", "", {}
    for d in deltas:
        for chunk in stream.chunks(0, d, None):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasoning += delta.reasoning_content or ""
            for call in delta.tool_calls or []:
                if call.id:
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
    return text, whole, (content, reasoning, list(calls.values()))


def test_the_ingress_keeps_special_tokens_only_when_markers_need_them(
    tokenizer, tiny_tokenizer_dir
):
    from transformers import AutoTokenizer

    plain_tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    for family in ("mistral", "llama3_json", "hermes"):  # markers that are plain text
        assert special_markers(plain_tokenizer, get_tool_parser(family), "qwen3") == (False, False)
    assert special_markers(tokenizer, get_tool_parser("pythonic"), "none") == (False, False)
    for family, keeps in [("mistral", True), ("llama3_json", True), ("hermes", False)]:
        req = chat_request(tokenizer, family)
        assert req.keeps_markers is keeps, family
        assert req.to_sampling_params(64).skip_special_tokens is (not keeps)
    # no tools offered: nothing to keep; the request's own false is kept
    assert not chat_request(tokenizer, "mistral", tool_choice="none").keeps_markers
    req = chat_request(tokenizer, "hermes", reasoning=Reasoning("deepseek_r1", opened=True))
    assert req.keeps_markers  # its <think> tags are special
    plain = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], skip_special_tokens=False
    )
    assert plain.to_sampling_params(8).skip_special_tokens is False


@pytest.mark.parametrize("family", ["mistral", "llama3_json"])
@pytest.mark.parametrize("mode", ["required", "named"])
def test_required_and_named_calls_parse_with_special_tokens_kept(
    llm, family_dirs, tokenizer, family, mode
):
    req = chat_request(tokenizer, family, "required")
    params = req.to_sampling_params(100)
    assert params.skip_special_tokens is False
    plan = {"tools": [PING], "mode": mode, "parallel": False, "format": family}
    params.structured = StructuredOutput("tool_calls", json.dumps(plan))
    params.temperature, params.seed = 1.0, 3
    deltas = run(
        llm, EngineRequest(prompt_of(llm, family_dirs, family), params, f"{family}-{mode}")
    )
    assert deltas[-1].finish_reason == "stop"
    text, whole, (content, _, calls) = answers(llm, req, family, deltas, mode)
    assert "<|im_end|>" not in text  # the stop token is not text
    assert whole.content is None and [c.function.name for c in whole.tool_calls] == ["ping"]
    assert isinstance(json.loads(whole.tool_calls[0].function.arguments)["loud"], bool)
    assert content == "" and calls == [
        [c.function.name, c.function.arguments] for c in whole.tool_calls
    ]


MARKED = {
    "mistral": (
        "Sure, checking. ",
        "[TOOL_CALLS]",
        '[{"name": "ping", "arguments": {"loud": true}}]',
    ),
    "llama3_json": (
        "Let me see. ",
        "<|python_tag|>",
        '{"name": "ping", "parameters": {"loud": false}}',
    ),
}


@pytest.mark.parametrize("family", list(MARKED))
def test_auto_answer_with_text_then_a_special_marker(llm, family_dirs, tokenizer, family):
    """The output's tokens are fixed (a resumed request's output, the marker its own special
    token id, then EOS forced by a logit bias): kept, the marker reaches the parser and the
    call after the text is found; skipped, it is lost and the call stays content."""
    tok = llm.tokenizer
    before, marker, call = MARKED[family]
    (marker_id,) = tok.encode(marker, add_special_tokens=False)
    ids = tok.encode(before, add_special_tokens=False) + [marker_id]
    ids += tok.encode(call, add_special_tokens=False)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = prompt_of(llm, family_dirs, family)
    req = chat_request(tokenizer, family)
    for keep in (True, False):
        params = req.to_sampling_params(len(ids) + 8)
        params.skip_special_tokens = not keep
        params.temperature, params.logit_bias = 0.0, {eos: 100.0}
        request = EngineRequest(prompt, params, f"{family}-{keep}", resume=Resume(ids, ""))
        deltas = run(llm, request)
        assert deltas[-1].finish_reason == "stop" and deltas[-1].new_token_ids[-1] == eos
        text, whole, (content, _, calls) = answers(llm, req, family, deltas, "auto")
        if not keep:
            assert marker not in text and not whole.tool_calls
            continue
        assert text == before + marker + call  # the marker written, no EOS text
        assert whole.content == before.strip() and content == before.strip()
        [got] = whole.tool_calls
        assert got.function.name == "ping"
        assert calls == [["ping", got.function.arguments]]
        assert json.loads(got.function.arguments) == {"loud": family == "mistral"}


def test_special_think_tags_split_reasoning_when_kept(llm, family_dirs):
    """deepseek_r1's template opens <think>; the model's `</think>` (a special token, pushed
    by a logit bias) ends the reasoning only when special tokens are kept."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(family_dirs["deepseek_r1"]))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "yes?"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok.encode(text, add_special_tokens=False)
    (end,) = tok.encode("</think>", add_special_tokens=False)
    thinking = Reasoning("deepseek_r1", opened=True)
    closed = 0
    for seed in range(6):
        params = SamplingParams(
            max_tokens=40, seed=seed, logit_bias={end: 5.0}, skip_special_tokens=False
        )
        deltas = run(llm, EngineRequest(prompt, params, f"think-{seed}"))
        out_ids = [t for d in deltas for t in d.new_token_ids]
        out = "".join(d.new_text for d in deltas)
        if end not in out_ids:
            continue
        closed += 1
        thought, content = thinking.split(out)
        head, _, rest = out.partition("</think>")
        assert thought == head and content == rest.lstrip()  # the tag in neither
        # skipped, the same tokens' text has no tag: all of it reads as reasoning
        skipped = SamplingParams(
            max_tokens=40, seed=seed, logit_bias={end: 5.0}, skip_special_tokens=True
        )
        deltas = run(llm, EngineRequest(prompt, skipped, f"think-skip-{seed}"))
        assert [t for d in deltas for t in d.new_token_ids] == out_ids
        assert thinking.split("".join(d.new_text for d in deltas))[1] == ""
    assert closed >= 2
