"""Migration from the ingress's side (router/fanout.py, router/migration.py): a stream whose
replica is lost after some of it reached the client continues on another replica from the
tokens and text the client has, into the same SSE stream (no text repeated or missing, usage
counted once, finish_reason and logprobs as if nothing happened), each choice on its own, up to
http.migration_limit times; a draining replica's hand-back moves a stream without counting
against the limit. Fake replicas that honour `resume` as the engine does (replica/request.py
Resume); the real thing is tests/integration/test_migration.py."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

pytest.importorskip("ray")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from replica.api import ReplicaDraining, RequestOutput, Resume  # noqa: E402
from replica.request import EngineRequest, SamplingParams  # noqa: E402
from router import fanout  # noqa: E402
from router.admission import Admission  # noqa: E402
from router.dialects import ChatDialect, CompletionDialect  # noqa: E402
from router.errors import MigrationLimitReached, classify_error  # noqa: E402
from router.fanout import ReplicaCalls  # noqa: E402
from router.migration import Migrations  # noqa: E402
from router.policy import Policy, RoutingConfig  # noqa: E402
from router.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from router.streaming import Answers, Ticket  # noqa: E402


class ActorDiedError(Exception):  # what Ray raises, matched by name (router/errors.py)
    pass


REPLICA_ACTOR = "SERVE_REPLICA::app#LLMServer#r0dead"  # the actor Ray's errors name


def words(prompt: list[int], max_tokens: int) -> list[str]:
    """The fake model's whole answer to a prompt, one piece of text per token."""
    return [f"w{prompt[0]}.{i} " for i in range(max_tokens)]


class Replicas:
    """A deployment handle over replicas that answer `pieces(prompt, max_tokens)` one token
    per delta and honour `resume` as the engine does: they continue after the tokens the
    client has, num_output_tokens cumulative, the original prompt's num_prompt_tokens. Each
    send fails as the script says: (deltas before the failure, the exception), None: none."""

    def __init__(self, script=(), pieces=words) -> None:
        self.script = list(script)
        self.pieces = pieces
        self.sent: list = []  # every GenerateRequest, in order
        self.generate = types.SimpleNamespace(remote=self._stream)
        self.generate_all = types.SimpleNamespace(remote=self._unary)

    def options(self, stream: bool = False) -> Replicas:
        return self

    def _deltas(self, request):
        self.sent.append(request)
        fail_after, exc = self.script.pop(0) if self.script else (None, None)
        sampling = request.sampling
        answer = self.pieces(request.prompt_token_ids, sampling.max_tokens)
        done = len(request.resume.output_token_ids) if request.resume is not None else 0
        for n, position in enumerate(range(done, len(answer))):
            if fail_after is not None and n == fail_after:
                raise exc(f"replica gone: {REPLICA_ACTOR} died")
            token = 1000 * request.prompt_token_ids[0] + position
            last = position == len(answer) - 1
            yield RequestOutput(
                request_id=request.request_id,
                new_token_ids=[token],
                new_text=answer[position],
                num_prompt_tokens=len(request.prompt_token_ids),
                num_output_tokens=position + 1,
                finish_reason=("length" if len(answer) == sampling.max_tokens else "stop")
                if last
                else None,
                new_logprobs=[(-0.5, {token: -0.5})] if sampling.logprobs is not None else None,
                prompt_logprobs=[(-1.0, {7: -1.0})]
                if n == 0 and sampling.prompt_logprobs
                else None,
            )
        if fail_after is not None and fail_after >= len(answer) - done:
            raise exc("replica gone after its last delta")

    async def _stream(self, request):
        for out in self._deltas(request):
            await asyncio.sleep(0)
            yield out

    async def _unary(self, request):
        result = None
        for out in self._deltas(request):
            result = out if result is None else result.merge(out)
        return result


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(fanout, "RETRY_PAUSE_S", 0.0)


def calls(replicas: Replicas, limit: int = 3) -> ReplicaCalls:
    return ReplicaCalls(replicas, Policy(RoutingConfig()), 16, Migrations(limit))


def choice(prompt: list[int], max_tokens: int = 6, **sampling) -> EngineRequest:
    return EngineRequest(
        prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling), ""
    )


def stream(calls_: ReplicaCalls, job: EngineRequest) -> list[RequestOutput]:
    async def run():
        return [out async for out in calls_.one_stream(job)]

    return asyncio.run(run())


def joined(outs: list[RequestOutput]) -> tuple[list[int], str]:
    return [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs)


def test_a_stream_lost_mid_way_continues_from_what_its_client_has():
    undisturbed = stream(calls(Replicas()), choice([3]))
    replicas = Replicas([(2, ActorDiedError)])
    c = calls(replicas)
    outs = stream(c, choice([3]))
    assert joined(outs) == joined(undisturbed)  # no token or text repeated or missing
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5, 6]
    assert outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])
    first, second = replicas.sent
    assert first.resume is None and first.request_id != second.request_id
    tokens, text = joined(undisturbed[:2])
    assert second.resume == Resume(tokens, text, 1)
    # the same choice: prompt and sampling as the client asked
    assert second.prompt_token_ids == first.prompt_token_ids and second.sampling == first.sampling
    assert c.migrations.counts == {"lost": 1, "drained": 0} and c.retries == 0
    assert c.migrations.gap_count == 1


def test_each_migration_logs_the_request_the_lost_replica_the_tokens_sent_and_the_count(caplog):
    replicas = Replicas([(2, ActorDiedError), (3, ReplicaDraining)])
    with caplog.at_level("INFO", logger="ray.serve"):
        stream(calls(replicas), choice([3], max_tokens=8))
    lines = [r.getMessage() for r in caplog.records if "continuing it on" in r.getMessage()]
    origin = replicas.sent[0].request_id
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"request {origin}: replica r0dead was lost (")
    assert "after 2 tokens reached the client" in lines[0] and "(migration 1)" in lines[0]
    assert lines[1].startswith(f"request {origin}: replica r0dead handed it back (draining)")
    assert "after 5 tokens reached the client" in lines[1] and "(migration 2)" in lines[1]


def test_a_stream_moves_again_and_ends_with_a_clear_error_past_the_limit():
    # lost after 1 delta each time: 2 migrations allowed, the third loss ends it
    replicas = Replicas([(1, ActorDiedError)] * 5)
    c = calls(replicas, limit=2)
    got: list[RequestOutput] = []

    async def run():
        async for out in c.one_stream(choice([4])):
            got.append(out)

    with pytest.raises(MigrationLimitReached) as info:
        asyncio.run(run())
    assert len(replicas.sent) == 3 and [r.resume.num_migrations for r in replicas.sent[1:]] == [
        1,
        2,
    ]
    assert joined(got)[1] == "w4.0 w4.1 w4.2 "  # what each replica sent before it was lost
    err = classify_error(info.value)
    assert err.status == 503 and "http.migration_limit = 2" in err.message, err.message
    assert c.migrations.counts["lost"] == 2


def test_migration_off_ends_a_stream_under_way_with_its_replicas_failure():
    replicas = Replicas([(2, ActorDiedError)])
    with pytest.raises(ActorDiedError):
        stream(calls(replicas, limit=0), choice([1]))
    assert len(replicas.sent) == 1


def test_a_draining_replicas_hand_back_moves_the_stream_without_using_the_limit():
    replicas = Replicas([(1, ReplicaDraining)] * 3)
    c = calls(replicas, limit=1)
    outs = stream(c, choice([5]))
    assert joined(outs) == joined(stream(calls(Replicas()), choice([5])))
    assert c.migrations.counts == {"lost": 0, "drained": 3}
    assert [r.resume.num_migrations for r in replicas.sent[1:]] == [1, 2, 3]


def test_a_failure_of_the_request_itself_does_not_move_it():
    replicas = Replicas([(2, ValueError)])
    with pytest.raises(ValueError):
        stream(calls(replicas), choice([1]))
    assert len(replicas.sent) == 1


def test_a_loss_after_the_last_delta_is_not_a_migration():
    replicas = Replicas([(6, ActorDiedError)])  # fails once all 6 deltas went out
    c = calls(replicas)
    assert len(stream(c, choice([2]))) == 6
    assert len(replicas.sent) == 1 and c.migrations.total == 0


def test_a_lost_unary_call_is_sent_again_from_scratch_within_the_limit():
    replicas = Replicas([(3, ActorDiedError)])
    c = calls(replicas, limit=1)
    [(_, out)] = asyncio.run(c.complete_all([(0, choice([6]))]))
    assert out.new_text == "".join(words([6], 6)) and out.num_output_tokens == 6
    assert [r.resume for r in replicas.sent] == [None, None] and c.retries == 1
    replicas = Replicas([(3, ActorDiedError)])
    with pytest.raises(ActorDiedError):  # limit 0: not sent again
        asyncio.run(calls(replicas, limit=0).complete_all([(0, choice([6]))]))
    assert len(replicas.sent) == 1


# -- through the SSE answer -------------------------------------------------------------------
class Tokenizer:
    chat_template = None

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


def sse_answer(replicas: Replicas, req, dialect, jobs, limit: int = 3) -> list[dict | str]:
    """The SSE events of a streamed request answered over `replicas`: JSON payloads, and
    "[DONE]"."""
    answers = Answers(calls(replicas, limit), Admission(), keepalive_s=30)
    ticket = Ticket(types.SimpleNamespace(release=lambda: None), deadline_s=60)
    answers.admission.enter(ticket.key)

    async def run() -> list[str]:
        return [event async for event in answers.stream(jobs, dialect, req, ticket)]

    events = []
    for chunk in asyncio.run(run()):
        for line in chunk.split("\n"):
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_n_choices_migrate_each_on_their_own_into_one_continuous_stream():
    req = CompletionRequest.model_validate(
        {"prompt": "x", "n": 2, "max_tokens": 6, "logprobs": 1, "stream": True,
         "stream_options": {"include_usage": True}}
    )  # fmt: skip
    jobs = [(0, choice([3, 9, 9], logprobs=1)), (1, choice([4, 9, 9], logprobs=1))]
    dialect = CompletionDialect(Tokenizer(), "m")
    # choice 0 is lost after 2 deltas and again after 1; choice 1 after 4 (order of sends
    # interleaves, so each send fails after 1 delta at most once everything has started)
    replicas = Replicas([(2, ActorDiedError), (4, ActorDiedError), (1, ActorDiedError)])
    events = sse_answer(replicas, req, dialect, jobs)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert not any("error" in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1  # one response
    texts, reasons, logprob_tokens = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
    for c in chunks:
        for ch in c.get("choices") or []:
            texts[ch["index"]] += ch["text"]
            if ch["finish_reason"] is not None:
                reasons[ch["index"]].append(ch["finish_reason"])
            if ch["logprobs"]:
                logprob_tokens[ch["index"]] += ch["logprobs"]["tokens"]
    assert texts == {0: "".join(words([3], 6)), 1: "".join(words([4], 6))}
    assert reasons == {0: ["length"], 1: ["length"]}
    assert logprob_tokens[0] == [f"<{3000 + i}>" for i in range(6)]
    assert logprob_tokens[1] == [f"<{4000 + i}>" for i in range(6)]
    usage = chunks[-1]["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
    assert len(replicas.sent) == 5


def test_past_the_limit_the_stream_ends_with_an_error_event_naming_it():
    req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 6, "stream": True})
    replicas = Replicas([(1, ActorDiedError)] * 3)
    events = sse_answer(replicas, req, CompletionDialect(Tokenizer(), "m"), [(0, choice([2]))], 1)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 503 and "http.migration_limit = 1" in error["message"], error
    assert "".join(c["choices"][0]["text"] for c in events[:-2]) == "w2.0 w2.1 "


def test_echo_and_prompt_logprobs_go_out_once_across_a_migration():
    req = CompletionRequest.model_validate(
        {"prompt": "x", "max_tokens": 4, "echo": True, "logprobs": 1, "stream": True}
    )
    from router.dialects import Echo

    jobs = [(0, choice([2, 5], max_tokens=4, logprobs=1, prompt_logprobs=1))]
    answers_echo = {0: Echo("PROMPT", [2, 5])}
    replicas = Replicas([(2, ActorDiedError)])
    answers = Answers(calls(replicas), Admission(), keepalive_s=30)
    ticket = Ticket(types.SimpleNamespace(release=lambda: None), deadline_s=60)
    dialect = CompletionDialect(Tokenizer(), "m")

    async def run() -> list[str]:
        return [e async for e in answers.stream(jobs, dialect, req, ticket, answers_echo)]

    payloads = [
        json.loads(line[6:])
        for chunk in asyncio.run(run())
        for line in chunk.split("\n")
        if line.startswith("data: {")
    ]
    text = "".join(p["choices"][0]["text"] for p in payloads)
    assert text == "PROMPT" + "".join(words([2, 5], 4))
    tokens = [t for p in payloads for t in p["choices"][0]["logprobs"]["tokens"]]
    assert tokens == ["<2>", "<5>"] + [f"<{2000 + i}>" for i in range(4)]


def test_a_tool_call_cut_by_a_migration_is_parsed_whole():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    pieces = [call[i : i + 7] for i in range(0, len(call), 7)]
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "weather?"}],
            "stream": True,
            "max_tokens": 64,
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        }
    )
    replicas = Replicas([(4, ActorDiedError)], pieces=lambda prompt, max_tokens: pieces)
    events = sse_answer(replicas, req, ChatDialect(Tokenizer(), "m"), [(0, choice([1], 64))])
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    calls_ = [
        tc
        for e in events[:-1]
        for ch in e["choices"]
        for tc in (ch["delta"].get("tool_calls") or [])
    ]
    assert len(calls_) >= 1 and calls_[0]["function"]["name"] == "get_weather"
    arguments = "".join(tc["function"].get("arguments") or "" for tc in calls_)
    assert json.loads(arguments) == {"city": "Oslo"}
    assert [ch["finish_reason"] for e in events[:-1] for ch in e["choices"]][-1] == "tool_calls"
    assert len(replicas.sent) == 2


def test_the_ingress_exposes_migrations_and_their_gaps():
    m = Migrations()
    m.note("lost")
    m.note("drained")
    m.observe_gap(0.3)
    m.observe_gap(100.0)
    families = {f.name: f for f in text_string_to_metric_families(m.exposition("ing").decode())}
    counts = {
        s.labels["reason"]: s.value
        for s in families["stepserve:ingress_migrations"].samples
        if s.name.endswith("_total")
    }
    assert counts == {"lost": 1.0, "drained": 1.0}
    gap = {
        (s.name, s.labels.get("le")): s.value
        for s in families["stepserve:ingress_migration_gap_seconds"].samples
    }
    assert gap[("stepserve:ingress_migration_gap_seconds_bucket", "0.25")] == 0
    assert gap[("stepserve:ingress_migration_gap_seconds_bucket", "0.5")] == 1
    assert gap[("stepserve:ingress_migration_gap_seconds_bucket", "60")] == 1
    assert gap[("stepserve:ingress_migration_gap_seconds_bucket", "+Inf")] == 2
    assert gap[("stepserve:ingress_migration_gap_seconds_count", None)] == 2
