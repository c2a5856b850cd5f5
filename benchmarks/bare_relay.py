"""A bare relay: the floor of what any gateway on Undertow's HTTP stack adds to a call.

    python -m benchmarks.bare_relay ENGINE_URL PROMPT_IDS [--port 0]

`benchmarks/gateway.py` part (a) pairs it with the engine's `/generate`, as it pairs the
gateway, and reads the gateway's own cost as the difference of the two. The relay does
what every call through a gateway needs and nothing more: aiohttp's server (on uvloop, no
access log, the gateway process's garbage-collector and malloc settings: `tune_gc`,
`tune_malloc`) takes an OpenAI chat request, sends the engine a streamed SGLang
`/generate` of fixed, pre-tokenized prompt IDs (`PROMPT_IDS`, a JSON list) over the
gateway's own `Http1Client`, parses the SSE events with orjson and answers a
chat.completion serialised by orjson. No session, chat template,
tokenizer, tool-call parser or store is on the path: the request's messages are not read.

`POST /admin/sessions` answers a record shaped like the gateway's, so the benchmark's
`open_session` works unchanged (every session is the same one). It prints
`bare relay listening on http://HOST:PORT` once it serves (the port 0 default is read back).
"""

import argparse
import asyncio
import contextlib
import time

import orjson
from aiohttp import web

from undertow.gateway.engines.http1 import Http1Client
from undertow.gateway.front.app import event_loop_factory, tune_gc, tune_malloc
from undertow.gateway.front.config import GatewayConfig

__all__ = ["BareRelay", "main"]

SSE_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}
SESSION_ID = "bare-relay"


class BareRelay:
    """Relays each chat call to one engine as a streamed `/generate` of `prompt_ids`.

    Invariant: every call generates from the same `prompt_ids`, whatever its messages;
    only `max_tokens` and `temperature` are taken from the request."""

    def __init__(self, engine_url: str, prompt_ids: list[int]):
        self.engine = Http1Client(engine_url)
        self.prompt_ids = prompt_ids

    def create_app(self) -> web.Application:
        app = web.Application(client_max_size=GatewayConfig.max_body_bytes)  # the gateway's
        app.router.add_post("/admin/sessions", self.open_session)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    async def open_session(self, request: web.Request) -> web.Response:
        return json_reply({"session_id": SESSION_ID, "api_key": SESSION_ID,
                           "base_url": f"http://{request.host}/v1"})

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        last = await self.generate(orjson.dumps({
            "input_ids": self.prompt_ids, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": body["max_tokens"],
                                "temperature": body.get("temperature", 1.0)}}))
        meta = last["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type")
        num_prompt_ids, num_completion_ids = len(self.prompt_ids), meta["completion_tokens"]
        return json_reply({
            "id": f"chatcmpl-{meta['id']}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model", SESSION_ID),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": last["text"]},
                         "finish_reason": "length" if finish == "length" else "stop"}],
            "usage": {"prompt_tokens": num_prompt_ids, "completion_tokens": num_completion_ids,
                      "total_tokens": num_prompt_ids + num_completion_ids}})

    async def generate(self, body: bytes) -> dict:
        """The last event of the engine's SSE reply to the `/generate` request `body`. The
        reply is read to its end (past `[DONE]`), so that its connection is kept."""
        last, buffer = None, b""
        async with self.engine.stream("POST", "/generate", [body], SSE_HEADERS) as reply:
            if reply.status != 200:
                raise web.HTTPBadGateway(text=f"the engine answered {reply.status}: "
                                              f"{(await reply.read())[:500]!r}")
            async for piece in reply.pieces():
                *events, buffer = (buffer + piece).split(b"\n\n")
                for event in events:
                    if event.startswith(b"data:") and event[5:].strip() != b"[DONE]":
                        last = orjson.loads(event[5:])
        if last is None or "meta_info" not in last:
            raise web.HTTPBadGateway(text=f"the engine's stream ended without a reply: {last}")
        return last


def json_reply(data: dict) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


async def serve(relay: BareRelay, host: str, port: int) -> None:
    """Serves `relay` until cancelled, as `undertow gateway serve` serves the gateway."""
    runner = web.AppRunner(relay.create_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(f"bare relay listening on http://{host}:{runner.addresses[0][1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        relay.engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_url", help="the engine's URL, e.g. http://127.0.0.1:30000")
    parser.add_argument("prompt_ids", help="the prompt's token IDs, a JSON list of ints")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 (default): a free port")
    args = parser.parse_args()
    prompt_ids = orjson.loads(args.prompt_ids)
    if not (isinstance(prompt_ids, list) and prompt_ids
            and all(isinstance(token_id, int) for token_id in prompt_ids)):
        parser.error(f"PROMPT_IDS must be a non-empty JSON list of ints, got {args.prompt_ids!r}")
    tune_gc()  # the gateway's process settings, so that only its logic differs
    tune_malloc()
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(
            loop_factory=event_loop_factory()) as runner:
        runner.run(serve(BareRelay(args.engine_url, prompt_ids), args.host, args.port))


if __name__ == "__main__":
    main()
