"""What every scaffold API shares: the session a request reaches, its JSON body
(size-limited), its fingerprint for retries, and Server-Sent Events with
keep-alives."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import orjson
from aiohttp import web

from undertow.gateway.calls import CallRequest
from undertow.gateway.errors import BadRequest, PayloadTooLarge
from undertow.gateway.sessions import Session, SessionRegistry

KEEPALIVE = object()
RETRY_HEADERS = ("x-stainless-retry-count", "x-retry-count")


def request_key(request: web.Request) -> str | None:
    authorization = request.headers.get("Authorization", "")
    if authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return request.headers.get("x-api-key") or request.headers.get("api-key")


def session_of(request: web.Request, sessions: SessionRegistry) -> Session:
    """The session from the path (`/s/{session}/v1/...`) or from the key alone."""
    return sessions.authenticate(request.match_info.get("session"), request_key(request))


async def read_json(request: web.Request, max_body_bytes: int) -> tuple[dict[str, Any], bytes]:
    """The body as a JSON object, and its raw bytes."""
    if request.content_length is not None and request.content_length > max_body_bytes:
        raise PayloadTooLarge(f"request body of {request.content_length} bytes is over the "
                              f"limit of {max_body_bytes} bytes; send less history")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body is over the limit of {max_body_bytes} bytes; "
                              "send less history") from None
    try:
        body = orjson.loads(raw)
    except (orjson.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body, raw


def fingerprint(session: Session, raw: bytes) -> str:
    return hashlib.sha256(session.session_id.encode() + b"\0" + raw).hexdigest()


def mark_retry(call: CallRequest, request: web.Request, session: Session,
               raw: bytes) -> CallRequest:
    """The call with its fingerprint and whether the SDK says it is a retry."""
    return replace(call, fingerprint=fingerprint(session, raw), is_retry=is_retry(request))


def is_retry(request: web.Request) -> bool:
    for name in RETRY_HEADERS:
        with contextlib.suppress(ValueError):
            if int(request.headers.get(name, "0")) > 0:
                return True
    return False


async def start_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    return response


def sse(data: Any, event: str | None = None) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


async def with_keepalive(items: AsyncIterator, interval_s: float) -> AsyncIterator:
    """Yields the items, and `KEEPALIVE` after each `interval_s` of silence. The
    pending `__anext__` is never cancelled by a keep-alive, only waited on again."""
    iterator = aiter(items)
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
