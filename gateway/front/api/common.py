"""What every scaffold API shares: the session a request reaches, its JSON body
(size-limited), its fingerprint for retries, JSON replies, and the loop that writes
a call as Server-Sent Events with keep-alives (`stream_events`, each API bringing its
`EventFormatter`; a client that leaves mid-reply is marked `CLIENT_LEFT`, see
`client_left`). Bodies are parsed and serialised with orjson: a long history's
request is parsed several times faster than by `json`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol

import orjson
import xxhash
from aiohttp import web

from undertow.gateway.engine_pool.admission import CALLER, Caller
from undertow.gateway.errors import BadRequest, GatewayError, PayloadTooLarge
from undertow.gateway.front.api.errors import SESSION_KEY, note_infra_error
from undertow.gateway.front.calls import CallRequest, CallRunner, Delta, Outcome
from undertow.gateway.front.sessions import Session, SessionRegistry

log = logging.getLogger(__name__)
KEEPALIVE = object()
CLIENT_LEFT = web.RequestKey("client_left", bool)
RETRY_HEADERS = ("x-stainless-retry-count", "x-retry-count")


def request_key(request: web.Request) -> str | None:
    authorization = request.headers.get("Authorization", "")
    if authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return request.headers.get("x-api-key") or request.headers.get("api-key")


def session_of(request: web.Request, sessions: SessionRegistry) -> Session:
    """The session from the path (`/s/{session}/v1/...`) or from the key alone, kept on
    the request (`SESSION_KEY`: an error reply of Undertow's own is noted on it)."""
    session = sessions.authenticate(request.match_info.get("session"), request_key(request))
    request[SESSION_KEY] = session
    return session


async def read_json(request: web.Request, max_body_bytes: int) -> tuple[dict[str, Any], bytes]:
    """The body as a JSON object, and its raw bytes."""
    raw = await read_body(request, max_body_bytes)
    return json_object(raw), raw


async def read_body(request: web.Request, max_body_bytes: int) -> bytes:
    """The body's bytes, at most `max_body_bytes` of them."""
    if request.content_length is not None and request.content_length > max_body_bytes:
        raise PayloadTooLarge(f"request body of {request.content_length} bytes is over the "
                              f"limit of {max_body_bytes} bytes; send less history")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body is over the limit of {max_body_bytes} bytes; "
                              "send less history") from None


def json_object(raw: bytes) -> dict[str, Any]:
    """`raw` parsed, which must be a JSON object (else `BadRequest`)."""
    try:
        body = orjson.loads(raw)
    except (orjson.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def fingerprint(raw: bytes, digest: str | None = None) -> str:
    """A request body's identity among its session's calls, for SDK retries: its length
    and its 128-bit XXH3 (`digest`, where the caller has it: `resent_body` hashes only a
    body's new bytes). What it keys, a session's replies and calls in flight, is in memory
    only and per session, so a cryptographic digest buys nothing; XXH3 reads 3.5 MB in
    0.06 ms (Python's SipHash `hash` took 0.7 ms, SHA-256 4 ms)."""
    return f"{len(raw):x}-{digest or xxhash.xxh3_128_hexdigest(raw)}"


def is_retry(request: web.Request) -> bool:
    """Whether the SDK says the request is a retry (a retry-count header above 0)."""
    for name in RETRY_HEADERS:
        with contextlib.suppress(ValueError):
            if int(request.headers.get(name, "0")) > 0:
                return True
    return False


def sse(data: Any, event: str | None = None) -> bytes:
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + payload + b"\n\n"


def json_reply(data: Any) -> web.Response:
    """A 200 JSON reply serialised by orjson (several times faster than `json.dumps` for
    replies with logprobs); a NaN (a logprob the engine did not report) becomes null."""
    return web.Response(body=orjson.dumps(data), content_type="application/json")


class EventFormatter(Protocol):
    """How one API writes a call as Server-Sent Events (see `stream_events`)."""

    def begin(self, call_id: str) -> list[bytes]:
        """The events before the call's first output (written once)."""
        ...

    def delta(self, delta: Delta) -> list[bytes]:
        """The events of new output."""
        ...

    def finish(self, outcome: Outcome) -> list[bytes]:
        """The closing events, once the call is recorded."""
        ...

    def keepalive(self) -> bytes:
        """What is written after `keepalive_s` of silence."""
        ...

    def error(self, error: GatewayError) -> bytes:
        """The event that ends a stream which fails after its first byte."""
        ...


async def stream_events(request: web.Request, items: AsyncGenerator, keepalive_s: float,
                        formatter: EventFormatter) -> web.StreamResponse:
    """Writes a call's `Delta`s and `Outcome` (`CallRunner.stream`) as the formatter's
    events, as they come, with keep-alives. An error before the first byte is raised
    (an ordinary error response); after it, the formatter's error event ends the stream
    (the call then counts with the error's status, and an error of Undertow's own is noted
    on its session: `errors.note_infra_error`).
    The last byte follows the `Outcome`, so a delivered reply is always recorded.

    A client that closes the connection mid-reply is no error: the call's iteration is
    closed at once (its engine request aborted, nothing recorded unless the `Outcome`
    was already), and the request is marked `CLIENT_LEFT` for the metrics."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    try:
        async with contextlib.aclosing(with_keepalive(items, keepalive_s)) as events:
            try:
                await _write_events(request, response, events, formatter)
            except GatewayError as error:
                if not response.prepared:
                    raise
                note_infra_error(request, error, streamed=True)
                await response.write(formatter.error(error))
        await response.write_eof()
    except ConnectionError:  # aiohttp's ClientConnectionResetError: the client has gone
        request[CLIENT_LEFT] = True
        log.info("%s %s: the client closed the connection mid-reply; the call was "
                 "abandoned", request.method, request.path)
    return response


async def _write_events(request: web.Request, response: web.StreamResponse,
                        events: AsyncIterator, formatter: EventFormatter) -> None:
    begun = False
    async for item in events:
        if not response.prepared:
            await response.prepare(request)
        if item is KEEPALIVE:
            await response.write(formatter.keepalive())
            continue
        if not begun:
            begun = True
            call_id = item.call_id if isinstance(item, Delta) else item.choices[0].call_id
            for data in formatter.begin(call_id):
                await response.write(data)
        for data in (formatter.delta(item) if isinstance(item, Delta)
                     else formatter.finish(item)):
            await response.write(data)


def client_left(request: web.Request, response: web.StreamResponse | None) -> bool:
    """Whether the client closed its connection before the reply's end: a stream it cut
    (`stream_events`), or a reply not yet sent whose connection is gone (a call that is
    not streamed runs to its end and is recorded; its reply waits for the SDK's retry)."""
    if request.get(CLIENT_LEFT, False):
        return True
    return (response is not None and not response.prepared
            and (request.transport is None or request.transport.is_closing()))


async def reply_to_call(request: web.Request, runner: CallRunner, session: Session,
                        call: CallRequest, stream: bool, keepalive_s: float,
                        body_of: Callable[[Outcome], Any],
                        formatter: Callable[[], EventFormatter]) -> web.StreamResponse:
    """The reply every scaffold API gives a call: one JSON body made by `body_of` from
    the recorded outcome, or (`stream`) the formatter's events as the call runs. The pool
    learns who the call is for (`CALLER`: its group, whether its client is connected)."""
    CALLER.set(Caller(session.group, lambda: not (request.transport is None
                                                   or request.transport.is_closing())))
    if not stream:
        return json_reply(body_of(await runner.complete(session, call)))
    return await stream_events(request, runner.stream(session, call), keepalive_s, formatter())


async def with_keepalive(items: AsyncGenerator, interval_s: float) -> AsyncGenerator:
    """Yields the items, and `KEEPALIVE` after each `interval_s` of silence. The
    pending `__anext__` is never cancelled by a keep-alive, only waited on again."""
    iterator = items  # an async generator: closed with `aclose` at the end
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEPALIVE
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        with contextlib.suppress(BaseException):
            await iterator.aclose()
