"""Tool-call grammars per family and the thinking gate, in the engine (no Ray): on a tiny
random model, tool_choice required and named yield calls that the family's parser parses and
that validate against the tool's schema; a JSON schema holds after a reasoning block that is
left free; a migrated request's replay goes through the same gate."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from replica.engine import LLM
from replica.request import EngineRequest, Resume, SamplingParams, StructuredOutput
from router.reasoning import Reasoning
from router.tool_parsers import get_tool_parser
from tests.parser_models import build_family_models

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
            "metric": {"type": "boolean"},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
PING = {
    "name": "ping",
    "parameters": {
        "type": "object",
        "properties": {"loud": {"type": "boolean"}},
        "required": ["loud"],
        "additionalProperties": False,
    },
}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, PING)}
BOUNDED = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "maximum": 99}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
FAMILIES = ["hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic"]
TEMPLATE_OF = {"hermes": "qwen3"}  # the model directory whose template writes each family


@pytest.fixture(scope="module")
def family_dirs(tiny_tokenizer_dir, tmp_path_factory):
    return build_family_models(tiny_tokenizer_dir, tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="module")
def llm(family_dirs):
    engine = LLM(
        model=str(family_dirs["qwen3"]),
        max_model_len=1024,
        num_kv_blocks=512,
        block_size=16,
        max_num_batched_tokens=256,
    )
    yield engine
    engine.shutdown()


def chat_prompt(family_dirs, family: str, tools: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(family_dirs[TEMPLATE_OF.get(family, family)]))
    openai_tools = [{"type": "function", "function": t} for t in tools]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"}],
        tools=openai_tools,
        add_generation_prompt=True,
        tokenize=False,
    )
    return tok.encode(text, add_special_tokens=False)


def tool_spec(family: str, mode: str, tools: list[dict], parallel: bool) -> StructuredOutput:
    plan = {"tools": tools, "mode": mode, "parallel": parallel, "format": family}
    return StructuredOutput("tool_calls", json.dumps(plan))


@pytest.mark.parametrize("family", FAMILIES)
def test_required_and_named_calls_parse_and_validate(llm, family_dirs, family):
    prompt = chat_prompt(family_dirs, family, [WEATHER, PING])
    params = [
        SamplingParams(max_tokens=160, temperature=1.0, seed=seed, structured=spec)
        for seed in range(4)
        for spec in (
            # one call: a random model given parallel calls may go on calling to max_tokens
            tool_spec(family, "required", [WEATHER, PING], parallel=False),
            tool_spec(family, "named", [WEATHER], parallel=True),
        )
    ]
    outs = llm.generate([prompt] * len(params), params)
    parser = get_tool_parser(family)
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop", (family, out.text)
        parsed = parser.parse(out.text, [WEATHER, PING])
        assert parsed.tool_calls, (family, out.text)
        assert parsed.content is None, (family, out.text)  # nothing but calls
        if i % 2:  # named
            assert [c.name for c in parsed.tool_calls] == ["get_weather"]
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_json_schema_holds_after_a_free_reasoning_block(llm, family_dirs):
    """deepseek_r1's template opens <think> in the prompt: the output thinks freely until
    </think> (pushed by a logit bias so the random model writes it), then the schema holds."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(family_dirs["deepseek_r1"]))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "yes or no?"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok.encode(text, add_special_tokens=False)
    (end,) = tok.encode("</think>", add_special_tokens=False)
    spec = StructuredOutput("json", json.dumps(BOUNDED), (end,))
    params = [
        SamplingParams(
            max_tokens=120, temperature=1.0, seed=seed, structured=spec, logit_bias={end: 4.0}
        )
        for seed in range(8)
    ]
    outs = llm.generate([prompt] * len(params), params)
    thinking = Reasoning("deepseek_r1", opened=True)
    free_thoughts = 0
    for out in outs:
        if end not in out.output_token_ids:
            continue  # ended (EOS) while still thinking: nothing was constrained
        thought, content = thinking.split(out.text)
        jsonschema.validate(json.loads(content), BOUNDED)
        assert out.finish_reason == "stop"
        free_thoughts += bool(thought and not thought.lstrip().startswith("{"))
    closed = sum(end in o.output_token_ids for o in outs)
    assert closed >= 4, [o.text for o in outs]
    assert free_thoughts >= 1  # the thinking was not held to the schema


def _run(engine, request: EngineRequest):
    engine.check_request(request)
    engine.add(request)
    deltas = []
    while not (deltas and deltas[-1].finished):
        deltas += [o for o in engine.step() if o.request_id == request.request_id]
    return deltas


def test_resume_replays_through_the_gate(llm, family_dirs):
    """A migrated request whose output already holds free thinking and </think> continues
    under its grammar; one whose resumed tokens break the grammar after the gate is refused."""
    from replica.errors import RequestRejected

    engine = llm.engine
    tok = llm.tokenizer
    (end,) = tok.encode("</think>", add_special_tokens=False)
    spec = StructuredOutput("json", json.dumps(BOUNDED), (end,))
    thought = tok.encode("hmm, not JSON at all } ] ", add_special_tokens=False)
    prompt = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=3, structured=spec)
    resume = Resume(thought + [end], tok.decode(thought + [end]))
    deltas = _run(engine, EngineRequest(prompt, params, "resume-ok", resume=resume))
    rest = "".join(d.new_text for d in deltas)
    assert deltas[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(rest), BOUNDED)
    bad = Resume(thought + [end] + thought[:1], "")
    with pytest.raises(RequestRejected, match="not allowed by the request's structured-output"):
        engine.add(EngineRequest(prompt, params, "resume-bad", resume=bad))


def test_gated_grammar_fills_no_mask_until_the_gate(llm):
    engine = llm.engine
    tok = llm.tokenizer
    end = tuple(tok.encode("a</think>", add_special_tokens=False))  # two tokens: a, </think>
    spec = StructuredOutput("json", json.dumps(BOUNDED), end)
    state = engine.structured.new_state(spec)
    vocab_words = (engine.vocab_size + 31) // 32
    row = torch.full((1, vocab_words), -1, dtype=torch.int32)
    state.fill(row, 0)
    assert bool((row == -1).all()) and state.gated
    brace = tok.encode("}", add_special_tokens=False)[0]
    assert state.accept(brace)  # free while gated
    assert state.accept(end[0]) and state.accept(end[0])  # a, a: still one token in
    assert state.gated
    assert state.accept(end[1]) and not state.gated
    state.fill(row, 0)
    assert not bool((row == -1).all())  # now masked
    assert not state.accept(brace)  # and enforced
    # the cache holds one grammar for the gated and the ungated spec
    before = engine.structured.num_compiled
    engine.structured.compile(StructuredOutput("json", json.dumps(BOUNDED)))
    assert engine.structured.num_compiled == before


def test_the_gate_crosses_the_engine_wire():
    """StructuredOutput.after travels to the engine core process unchanged (and hashable)."""
    import msgspec

    from replica.engine.wire import Add

    spec = StructuredOutput("json", json.dumps(BOUNDED), (5, 6))
    request = EngineRequest([1, 2], SamplingParams(structured=spec), "wire")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(Add(request)), type=Add)
    assert back.request.sampling.structured == spec
    assert hash(back.request.sampling.structured) == hash(spec)


def test_fill_bitmask_writes_its_rows_of_a_reused_buffer_whole(llm):
    """The runner's buffer holds last step's masks: a row it names is overwritten whole (a
    gated grammar's with every token allowed), a row it does not name is left alone."""
    from replica.structured import fill_bitmask

    engine = llm.engine
    tok = llm.tokenizer
    end = tuple(tok.encode("a</think>", add_special_tokens=False))
    free = engine.structured.new_state(StructuredOutput("json", json.dumps(BOUNDED)))
    gated = engine.structured.new_state(StructuredOutput("json", json.dumps(BOUNDED), end))
    words = (engine.vocab_size + 31) // 32
    buffer = torch.zeros((4, words), dtype=torch.int32)  # stale: allows nothing
    expected = fill_bitmask([free], engine.vocab_size)[0]
    out = fill_bitmask([free, gated], engine.vocab_size, buffer, [3, 1])
    assert out is buffer
    assert torch.equal(buffer[3], expected) and not bool((expected == -1).all())
    assert bool((buffer[1] == -1).all())
    assert bool((buffer[[0, 2]] == 0).all())
