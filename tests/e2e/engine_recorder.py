"""Recording relays for real-model sessions: HTTP servers that pass every request to an
upstream URL as it came and every reply back as it came (streamed replies chunk by chunk),
and keep a record of their own, read from the raw JSON by this module alone (not by the
gateway's code, whose reading is what the tests check).

- `EngineRecorder` sits between the gateway and a real engine. For the token-in/token-out
  routes it keeps, per generation, the prompt IDs sent and the output IDs the engine
  returned: SGLang's `POST /generate` (the built-in engine: `input_ids` in, `output_ids`
  out, whole or, when streamed, per event either cumulative, SGLang's default, or deltas,
  `--incremental-streaming-output`, told apart by `meta_info.completion_tokens`), and
  vLLM's `POST /inference/v1/generate` (`token_ids` in, `choices[0].token_ids` out, whole
  or as streamed deltas).
- `ScaffoldRecorder` sits between a scaffold and the gateway and keeps the JSON body of each
  model call (`/v1/chat/completions`, `/v1/responses`, `/v1/messages`). With
  `temperature` set, it writes that temperature into each call's body: Codex and Claude
  Code send none (the gateway's default is 1.0) and have no setting for it, and a small
  model's sessions are only repeatable when sampled greedily. With `max_calls`, a model
  call past that many is answered 400 (`turn limit`) without reaching the gateway: a bound
  on the turns of a scaffold that has none of its own (Codex's `exec`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp
from aiohttp import web

SGLANG_GENERATE, VLLM_GENERATE = "/generate", "/inference/v1/generate"
MODEL_CALLS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
HOP_HEADERS = ("host", "content-length", "transfer-encoding", "connection")


@dataclass
class Generation:
    """One generation as the engine saw it: the prompt IDs it was sent, the IDs it sent back."""

    input_ids: list[int]
    output_ids: list[int]
    stream: bool


def _sglang_output(event: dict, so_far: list[int]) -> list[int]:
    ids = list(event.get("output_ids") or ())
    num_total = (event.get("meta_info") or {}).get("completion_tokens")
    return ids if num_total == len(ids) else so_far + ids


def _vllm_output(event: dict, so_far: list[int]) -> list[int]:
    choices = event.get("choices") or ()
    return so_far + list(choices[0].get("token_ids") or ()) if choices else so_far


OUTPUT_READERS = {SGLANG_GENERATE: _sglang_output, VLLM_GENERATE: _vllm_output}


def _sse_events(buffer: bytes) -> tuple[list[dict], bytes]:
    """The complete `data:` events in `buffer` and what is left after the last one."""
    *complete, rest = buffer.split(b"\n\n")
    events = []
    for block in complete:
        for line in block.splitlines():
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                events.append(json.loads(line[5:]))
    return events, rest


class Relay:
    """Passes everything to `upstream`; subclasses see each request's body before it goes
    (`outgoing`, which may return a changed body) and each reply after it came back
    (`returned`, with the SSE events of a streamed reply)."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self):
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                           auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()
        await self._http.close()

    def outgoing(self, request: web.Request, body: bytes) -> bytes | web.Response:
        """The body to send on, or a reply to give instead of sending it."""
        return body

    def returned(self, request: web.Request, body: bytes, status: int, reply: bytes,
                 events: list[dict] | None) -> None:
        return None

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        body = self.outgoing(request, await request.read())
        if isinstance(body, web.Response):
            return body
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with self._http.request(request.method, self.upstream + request.path_qs,
                                      data=body, headers=headers) as upstream:
            reply_headers = {k: v for k, v in upstream.headers.items()
                             if k.lower() not in HOP_HEADERS}
            reply = web.StreamResponse(status=upstream.status, headers=reply_headers)
            await reply.prepare(request)
            streamed = upstream.content_type == "text/event-stream"
            sent, pending, events = bytearray(), b"", []
            async for chunk in upstream.content.iter_any():
                await reply.write(chunk)
                sent += chunk
                if streamed:
                    new_events, pending = _sse_events(pending + chunk)
                    events += new_events
            await reply.write_eof()
        self.returned(request, body, upstream.status, bytes(sent), events if streamed else None)
        return reply


class EngineRecorder(Relay):
    """Between the gateway and an engine; `generations` in the order they ended."""

    def __init__(self, upstream: str):
        super().__init__(upstream)
        self.generations: list[Generation] = []

    def returned(self, request, body, status, reply, events) -> None:
        read = OUTPUT_READERS.get(request.path)
        if read is None or request.method != "POST" or status != 200:
            return
        sent = json.loads(body)
        input_ids = sent["input_ids"] if request.path == SGLANG_GENERATE else sent["token_ids"]
        output_ids: list[int] = []
        for event in events if events is not None else [json.loads(reply)]:
            output_ids = read(event, output_ids)
        self.generations.append(Generation(list(input_ids), output_ids, events is not None))


class ScaffoldRecorder(Relay):
    """Between a scaffold and the gateway; `calls` holds each model call's body as sent
    on (after `temperature`, when given, was written into it)."""

    def __init__(self, upstream: str, temperature: float | None = None,
                 max_calls: int | None = None):
        super().__init__(upstream)
        self.temperature, self.max_calls = temperature, max_calls
        self.calls: list[dict] = []
        self.num_refused = 0

    def outgoing(self, request, body) -> bytes | web.Response:
        if request.method != "POST" or not request.path.endswith(MODEL_CALLS):
            return body
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.num_refused += 1
            return web.json_response({"error": {
                "message": f"turn limit: this test allows {self.max_calls} model calls",
                "type": "invalid_request_error", "code": "turn_limit"}}, status=400)
        call = json.loads(body)
        if self.temperature is not None:
            call["temperature"] = self.temperature
        self.calls.append(call)
        return json.dumps(call).encode()
