"""POST /v1/embeddings: each input of the request tokenized and checked against the model, sent
as a pooling request of its own (EngineRequest.pooling) through the model's replica calls, so
the load-aware router places it and the replica's engine batches it with whatever else runs;
the vectors gathered in input order. The guard, admission, `model` resolution (a model or an
adapter) and deadline are the generating endpoints' (router/ingress_core.py)."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from replica.api import (
    EngineRequest,
    PoolingRequest,
    RequestRejected,
    SamplingParams,
    traced_jobs,
    traced_request,
)
from router.errors import bad_request
from router.protocol.embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    encode_embedding,
)
from router.streaming import Ticket

# a pooling request samples nothing; the engine reads none of these
_POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)


def check_dimensions(dimensions: int | None, info: dict, model_name: str) -> None:
    """400 for `dimensions` the model cannot give: one it does not declare (Matryoshka), or
    wider than its hidden size."""
    if dimensions is None:
        return
    embedding = info.get("embedding") or {}
    hidden = embedding.get("hidden_size")
    matryoshka = embedding.get("matryoshka")
    if hidden is not None and dimensions > hidden:
        raise bad_request(
            f"dimensions={dimensions} is more than the model {model_name!r}'s embedding size "
            f"of {hidden}",
            "dimensions",
        )
    if not matryoshka:
        raise bad_request(
            f"dimensions={dimensions} is not supported by the model {model_name!r}: it is not a "
            "Matryoshka model (its config.json declares neither matryoshka_dimensions nor "
            "is_matryoshka), so a cut embedding would not be meaningful",
            "dimensions",
        )
    if isinstance(matryoshka, list) and dimensions not in matryoshka:
        raise bad_request(
            f"dimensions={dimensions} is not one the model {model_name!r} was trained for: "
            f"choose one of {matryoshka}",
            "dimensions",
        )


def tokenize_inputs(req: EmbeddingRequest, tokenizer) -> list[list[int]]:
    return [
        tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
        if isinstance(item, str)
        else list(item)
        for item in req.inputs
    ]


def check_inputs(prompts: list[list[int]], limits) -> None:
    """400 naming the input at fault: a token outside the vocabulary, more tokens than
    max_model_len, more KV blocks than the replica has."""
    for index, ids in enumerate(prompts):
        try:
            limits.check_prompt(ids)
            limits.check_pooling_length(len(ids), index)
            limits.check_blocks(len(ids), 0)
        except RequestRejected as exc:
            message = str(exc)
            if not message.startswith("input "):
                message = f"input {index}: {message}"
            raise bad_request(message, "input") from None


@traced_request
async def serve_embeddings(core, request: Request) -> Response:
    """The whole answer of one /v1/embeddings request (`core`: the IngressCore)."""
    core.guard.check_auth(request)
    slot = core.guard.admit(core.guard.client_key(request))
    ticket = None
    try:
        deadline_s = core.deadline_s(request)
        req = await core.read_request(request, EmbeddingRequest)
        core.refuse_unknown(req.unknown_fields)
        model, lora = await core.resolve(req.model)
        core.admit_by_wait(req, deadline_s)
        await model.tokenizer_loaded()
        served_name = req.model or model.name
        check_dimensions(req.dimensions, await model.model_info(), served_name)
        prompts = tokenize_inputs(req, model.tokenizer)
        check_inputs(prompts, await model.engine_limits())
        pooling = PoolingRequest(model.engine.pooling_type, req.normalize, req.dimensions)
        jobs = [
            (i, EngineRequest(ids, _POOLING_SAMPLING, "", lora=lora, pooling=pooling))
            for i, ids in enumerate(prompts)
        ]
        jobs = traced_jobs(jobs, served_name)
        ticket = Ticket(slot, deadline_s)
        core.admission.enter(ticket.key, req.priority)
        try:
            results = await asyncio.wait_for(model.calls.complete_all(jobs), ticket.remaining_s())
        except asyncio.TimeoutError:
            raise ticket.timeout_error() from None
        core.admission.started(ticket.key, streamed=False)
        data = [
            EmbeddingData(index=i, embedding=encode_embedding(out.embedding, req.encoding_format))
            for i, out in sorted(results, key=lambda r: r[0])
        ]
        tokens = sum(len(ids) for ids in prompts)
        body = EmbeddingResponse(
            data=data,
            model=served_name,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )
        return JSONResponse(body.model_dump())
    finally:
        if ticket is not None:
            core.admission.leave(ticket.key)
        slot.release()
