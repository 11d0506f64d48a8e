"""bench/serving.py's streaming client against a scripted SSE server (aiohttp, loopback): when
a first token counts as arrived."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from bench.serving import send_request
from sim.workloads import RequestSpec


async def _serve_and_send(body: dict, gap_s: float = 0.5):
    """A server whose answer's first token has no text yet (held back), then `gap_s` later a
    chunk with text; returns send_request's result."""

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k, (text, ids) in enumerate((("", [11]), ("hi", [12]))):
            if k:
                await asyncio.sleep(gap_s)
            choice = {"index": 0, "text": text}
            if (await request.json()).get("return_token_ids"):
                choice["token_ids"] = ids
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"usage": {"completion_tokens": 2}, "choices": []}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            return await send_request(
                session, f"http://127.0.0.1:{port}/v1/completions", body,
                RequestSpec([1, 2, 3], 2), 0.0,
            )  # fmt: skip
    finally:
        await runner.cleanup()


def test_a_held_back_first_token_counts_when_token_ids_come_with_it():
    with_ids = asyncio.run(_serve_and_send({"prompt": [1, 2, 3], "return_token_ids": True}))
    text_only = asyncio.run(_serve_and_send({"prompt": [1, 2, 3]}))
    assert with_ids.success and text_only.success
    assert with_ids.output_len == text_only.output_len == 2
    # with ids the first token is the first chunk; without, the first chunk with text
    # (the second chunk is written 0.5 s after the first: the first was read before it)
    assert with_ids.ttft < with_ids.e2e - 0.4 and len(with_ids.itl) == 1
    assert text_only.ttft >= 0.5 and text_only.itl == []
