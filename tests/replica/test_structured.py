"""Structured outputs and prompt logprobs in the engine (no Ray): grammar-constrained requests
batched with free ones, every kind of constraint, tool-call grammars, prompt logprobs against
transformers; and a real JSON schema on the default model."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from replica.engine import LLM
from replica.request import SamplingParams, StructuredOutput
from replica.structured import StructuredOutputError, check, tool_call_tag
from router.tool_calls import parse_tool_calls

# every value is bounded: a random model's output always ends (the grammar then allows EOS only)
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "ok", "tag", "count"],
    "additionalProperties": False,
}


def engine_fields(model_dir, **overrides) -> dict:
    fields = {
        "model": str(model_dir),
        "max_model_len": 256,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 64,
        "num_kv_blocks": 128,
        "block_size": 16,
    }
    fields.update(overrides)
    return fields


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(**engine_fields(tiny_llama_dir))
    yield engine
    engine.shutdown()


def json_spec(schema: dict) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema))


def prompts(llm, k: int) -> list[list[int]]:
    words = ["red", "the cache", "blocks of", "a fox", "numbers 12", "json", "tools", "why"]
    return [llm.tokenizer.encode(f"{words[i % len(words)]} {i}: ") for i in range(k)]


def test_mixed_batch_constrained_outputs_validate_and_free_ones_are_untouched(llm):
    ids = prompts(llm, 8)
    spec = json_spec(BOUNDED_SCHEMA)
    free = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in ids]
    alone = llm.generate(ids, free)  # the free requests without any constrained neighbour
    params = [
        SamplingParams(max_tokens=80, temperature=0 if i % 4 == 0 else 1.0, seed=i, structured=spec)
        if i % 2 == 0
        else free[i]
        for i in range(len(ids))
    ]
    outs = llm.generate(ids, params)
    for i, out in enumerate(outs):
        if i % 2 == 0:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), BOUNDED_SCHEMA)
        else:  # a batch neighbour's grammar does not change a free request's tokens
            assert out.output_token_ids == alone[i].output_token_ids


def test_each_kind_of_constraint(llm):
    ids = prompts(llm, 1)[0]
    cases = [
        (StructuredOutput("regex", r"[a-c]{2,4}@(x|y)\.com"), r"[a-c]{2,4}@(x|y)\.com"),
        (StructuredOutput("choice", json.dumps(["alpha", "beta", "gamma"])), r"alpha|beta|gamma"),
        (StructuredOutput("grammar", 'root ::= "(" [0-9] ("+" [0-9])? ")"'), r"\(\d(\+\d)?\)"),
    ]
    for seed in range(3):
        for spec, pattern in cases:
            params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, structured=spec)
            (out,) = llm.generate([ids], params)
            assert out.finish_reason == "stop"
            assert re.fullmatch(pattern, out.text), (spec.kind, out.text)
    # json_object: any JSON object; a random model may not close it within max_tokens, but
    # when it stops, it parses
    for seed in range(4):
        params = SamplingParams(
            max_tokens=60, temperature=1.0, seed=seed, structured=StructuredOutput("json_object")
        )
        (out,) = llm.generate([ids], params)
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


def test_tool_call_grammars_always_parse(llm):
    tools = [
        {
            "name": "set_light",
            "parameters": {
                "type": "object",
                "properties": {"on": {"type": "boolean"}, "room": {"enum": ["hall", "den"]}},
                "required": ["on", "room"],
            },
        },
        {
            "name": "wait",
            "parameters": {
                "type": "object",
                "properties": {"seconds": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["seconds"],
            },
        },
    ]
    ids = prompts(llm, 1)[0]
    for mode, subset, parallel in [
        ("named", tools[1:], False),
        ("required", tools, False),
        ("required", tools, True),
    ]:
        spec = StructuredOutput(
            "tool_calls", json.dumps({"tools": subset, "mode": mode, "parallel": parallel})
        )
        for seed in range(3):
            params = SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured=spec)
            (out,) = llm.generate([ids], params)
            parsed = parse_tool_calls(out.text)
            if parallel and out.finish_reason == "length":
                # a random model may keep calling; every call it completed parses
                assert parsed.tool_calls, out.text
            else:
                assert out.finish_reason == "stop", out.text
                assert parsed.content is None and parsed.tool_calls, out.text
            if not parallel:
                assert len(parsed.tool_calls) == 1
            for call in parsed.tool_calls:
                tool = next(t for t in subset if t["name"] == call.name)
                jsonschema.validate(json.loads(call.arguments), tool["parameters"])


def test_bad_constraints_name_the_problem():
    bad = [
        (json_spec({"type": "objectx"}), "objectx"),
        (StructuredOutput("json", "{not json"), "not valid JSON"),
        (StructuredOutput("regex", "a(b"), "parenthesis"),
        (StructuredOutput("grammar", "root ::= undefined_rule"), "undefined_rule"),
        (StructuredOutput("choice", "[]"), "non-empty"),
    ]
    for spec, needle in bad:
        with pytest.raises(StructuredOutputError, match=re.escape(needle)):
            check(spec)
    with pytest.raises(StructuredOutputError, match="at least one tool"):
        tool_call_tag([], "required", True)


def test_constraint_refusals_in_sampling_params():
    spec = StructuredOutput("json_object")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured=spec, ignore_eos=True)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(structured=spec, min_tokens=3)


def test_compiled_grammars_are_cached(llm):
    spec = json_spec({"type": "object", "properties": {"z": {"type": "boolean"}}})
    before = llm.engine.structured.num_compiled
    ids = prompts(llm, 3)
    llm.generate(ids, [SamplingParams(max_tokens=20, temperature=0, structured=spec)] * 3)
    assert llm.engine.structured.num_compiled == before + 1


def hf_prompt_logprobs(model_dir, ids: list[int], k: int) -> list[tuple[float, dict[int, float]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    out = []
    for pos in range(len(ids) - 1):
        values, top = logprobs[pos].topk(k)
        out.append((logprobs[pos, ids[pos + 1]].item(), dict(zip(top.tolist(), values.tolist()))))
    return out


def assert_logprobs_close(got, want) -> None:
    assert len(got) == len(want)
    for (lp, top), (ref_lp, ref_top) in zip(got, want):
        assert lp == pytest.approx(ref_lp, abs=1e-4)
        assert list(top) == list(ref_top)
        assert list(top.values()) == pytest.approx(list(ref_top.values()), abs=1e-4)


def test_prompt_logprobs_match_transformers_across_chunks_and_cache(tiny_llama_dir):
    """Prompt logprobs over a prompt longer than the step's token budget (three chunks), after
    another request has cached the prompt's first blocks (the prompt must still run in full),
    and in a batch with other requests."""
    llm = LLM(**engine_fields(tiny_llama_dir, max_num_batched_tokens=32))
    try:
        ids = llm.tokenizer.encode(" ".join(f"block {i} of the cache" for i in range(14)))[:90]
        assert len(ids) == 90
        want = hf_prompt_logprobs(tiny_llama_dir, ids, k=3)
        llm.generate([ids[:64]], SamplingParams(max_tokens=2, temperature=0))  # cache warm
        params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3)
        others = prompts(llm, 3)
        outs = llm.generate(
            [ids, *others], [params] + [SamplingParams(max_tokens=5, temperature=0)] * 3
        )
        assert outs[0].num_cached_tokens == 0  # no prefix hit: every position was computed
        assert_logprobs_close(outs[0].prompt_logprobs, want)
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_default_model_answers_a_real_schema():
    """SmolLM2-135M-Instruct, asked through its chat template for a person as JSON: the
    output stops and validates against the schema."""
    from replica.default_model import default_model_dir

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    model_dir = default_model_dir()
    llm = LLM(model=str(model_dir), max_model_len=512, num_kv_blocks=64, block_size=16)
    try:
        tok = llm.tokenizer
        text = tok.apply_chat_template(
            [{"role": "user", "content": "Invent a person: name, age and city, as JSON."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        ids = tok.encode(text, add_special_tokens=False)
        params = SamplingParams(max_tokens=60, temperature=0, structured=json_spec(schema))
        (out,) = llm.generate([ids], params)
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    finally:
        llm.shutdown()


def _byte_token(tokenizer, byte: int) -> int:
    """The id of the byte-level BPE token of one byte (GPT-2's byte-to-unicode mapping)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return tokenizer.convert_tokens_to_ids(chars[byte])


@pytest.mark.parametrize("bounded", [True, False])
def test_json_strings_refuse_control_characters_and_surrogates(llm, bounded):
    """Guards against two holes in xgrammar 0.2.9's JSON strings (replica/structured.py): raw
    control characters in length-bounded strings, and UTF-8-encoded surrogates in any string."""
    string = {"type": "string", "maxLength": 12} if bounded else {"type": "string"}
    spec = json_spec({"type": "object", "properties": {"s": string}, "required": ["s"]})
    structured = llm.engine.structured
    tok = llm.tokenizer

    def accepts(raw: bytes) -> bool:
        state = structured.new_state(spec)
        assert state.matcher.accept_string('{"s": "ab')
        return all(state.accept(_byte_token(tok, b)) for b in raw)

    assert accepts("é".encode())  # a real two-byte character
    assert not accepts(b"\x0e")  # a raw control character
    assert not accepts(b"\xed\xa9\xb1")  # the encoding of surrogate U+DA71
