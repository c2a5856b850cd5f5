"""The HTTP side of the engine drivers: JSON requests and SSE streams to one engine, with
errors mapped to `EngineError`s (`HttpTransport`), and what the SGLang and vLLM drivers share
(`HttpEngine`). Streams go over `http1.Http1Client` (keep-alive kept, vectored writes)."""

import io
import json
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import orjson

from undertow.gateway.engines.http1 import Http1Client, HttpError
from undertow.gateway.engines.protocol import EngineRejected, EngineUnavailable

__all__ = ["HttpEngine", "HttpTransport", "error_message"]

CONNECT_TIMEOUT_S = 10.0
JSON_HEADERS = {"Content-Type": "application/json"}
SSE_HEADERS = {**JSON_HEADERS, "Accept": "text/event-stream"}


def error_message(body: str) -> str:
    """The human message inside an engine's error body (SGLang, vLLM and FastAPI forms)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip() or "(empty reply)"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("error", "message", "detail"):
            if data.get(key):
                return str(data[key])
    return body.strip()


def _sse_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The `data:` payloads of the complete SSE events at the start of `buffer`, and the
    rest (an event not yet complete). Events are split by hand rather than by lines:
    a cumulative chunk of a long generation is one line of hundreds of KiB. The usual
    event (one `data:` line, LF line ends) is sliced once; an event of several lines, or
    a stream with CRLF line ends, takes the general way."""
    if b"\r" in buffer:
        buffer = buffer.replace(b"\r\n", b"\n")
    *events, rest = buffer.split(b"\n\n")
    data = []
    for event in events:
        if b"\n" not in event:
            if event.startswith(b"data:"):
                data.append(event[5:].strip())
        else:
            data += [line[5:].strip() for line in event.split(b"\n")
                     if line.startswith(b"data:")]
    return data, rest


def _event(data: bytes) -> dict:
    """One SSE event's JSON: orjson (several times faster), or `json` for the NaN and
    Infinity literals that an engine serialising with Python's `json` may send."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


class HttpTransport:
    """JSON requests and SSE streams to one engine, with errors mapped to `EngineError`s.

    4xx replies raise `EngineRejected` with the engine's message; connection failures, 5xx
    replies and streams that break off raise `EngineUnavailable`.
    """

    def __init__(self, url: str, session: aiohttp.ClientSession | None = None):
        self.url = url.rstrip("/")
        self._session = session
        self._owns_session = session is None
        self._streams = Http1Client(self.url, connect_timeout_s=CONNECT_TIMEOUT_S)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
            # orjson: a long prompt's `input_ids` take ~15x less time than with json.dumps.
            self._session = aiohttp.ClientSession(
                timeout=timeout, json_serialize=lambda value: orjson.dumps(value).decode())
        return self._session

    async def close(self) -> None:
        self._streams.close()
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def _check(self, reply: aiohttp.ClientResponse, path: str) -> None:
        if reply.status >= 400:
            await self._raise_for(reply.status, await reply.text(), path)

    async def _raise_for(self, status: int, body: str, path: str) -> None:
        message = error_message(body)
        if status < 500:
            raise EngineRejected(message, status=status, url=self.url + path)
        raise EngineUnavailable(f"{self.url}{path} answered {status}: {message}")

    async def request(self, method: str, path: str, body: dict | None = None,
                      params: dict | None = None) -> Any:
        """Send one request; return the parsed JSON reply (any JSON value: each caller
        reads the shape its path answers), or its text if not JSON."""
        try:
            async with self._client().request(method, self.url + path, json=body,
                                              params=params) as reply:
                await self._check(reply, path)
                text = await reply.text()
        except aiohttp.ClientError as error:
            raise EngineUnavailable(f"engine at {self.url} unreachable ({path}): "
                                    f"{error!r}") from error
        try:
            return json.loads(text) if text.strip() else {}
        except ValueError:
            return text

    async def sse(self, path: str, body: dict | list[bytes]) -> AsyncGenerator[dict, None]:
        """POST `body` (a JSON object, or its bytes in pieces) and yield each `data:` event
        of the SSE reply until `[DONE]` (`sse_batches`, one by one)."""
        async for events in self.sse_batches(path, body):
            for event in events:
                yield event

    async def sse_batches(self, path: str, body: dict | list[bytes]
                          ) -> AsyncGenerator[list[dict], None]:
        """POST `body` (a JSON object, or its bytes in pieces) and yield the `data:` events
        of the SSE reply until `[DONE]`, in lists: those that arrived together (one read
        of the connection), so that a reader may skip what a later one repeats.

        An event `{"error": ...}` raises `EngineRejected`; a stream that ends without
        `[DONE]` raises `EngineUnavailable`. It goes over `Http1Client` (see there why),
        and reads the body to its end, so that the connection is kept for the next one.
        """
        # The body as bytes straight from orjson (tuples of IDs too): a long prompt's
        # `input_ids` are serialised once, not also decoded to str and encoded back.
        pieces = [orjson.dumps(body)] if isinstance(body, dict) else body
        done = False
        try:
            async with self._streams.stream("POST", path, pieces, SSE_HEADERS) as reply:
                if reply.status >= 400:
                    await self._raise_for(reply.status, (await reply.read()).decode(
                        "utf-8", "replace"), path)
                buffer = b""
                async for piece in reply.pieces():
                    if done:
                        continue
                    data, buffer = _sse_events(buffer + piece)
                    events = []
                    for item in data:
                        if item == b"[DONE]":
                            done = True
                            break
                        event = _event(item)
                        if "error" in event and len(event) == 1:
                            raise EngineRejected(error_message(item.decode()),
                                                 url=self.url + path)
                        events.append(event)
                    if events:
                        yield events
        except HttpError as error:
            if not done:
                raise EngineUnavailable(f"stream from {self.url}{path} failed: {error}"
                                        ) from error
        if not done:
            raise EngineUnavailable(f"stream from {self.url}{path} ended without [DONE]")

    async def post_bytes(self, path: str, *, body: dict | None = None,
                         data: bytes | None = None) -> tuple[bytes, dict[str, str]]:
        """POST a JSON `body` or raw `data`; return the reply's bytes and headers."""
        stream = None if data is None else io.BytesIO(data)  # large bytes: aiohttp warns
        try:
            async with self._client().post(self.url + path, json=body, data=stream) as reply:
                await self._check(reply, path)
                return await reply.read(), dict(reply.headers)
        except aiohttp.ClientError as error:
            raise EngineUnavailable(f"engine at {self.url} unreachable ({path}): "
                                    f"{error!r}") from error

    async def ok(self, path: str) -> bool:
        """True when `GET path` answers 200; never raises."""
        return await self.status(path) == 200

    async def status(self, path: str) -> int | None:
        """The status of `GET path`, None when there is no answer; never raises."""
        try:
            async with self._client().get(self.url + path) as reply:
                return reply.status
        except (aiohttp.ClientError, TimeoutError):
            return None


class HttpEngine:
    """What the HTTP engine drivers share: the transport to `url`, the async context
    manager, and the capabilities both SGLang and vLLM have."""

    capabilities = frozenset({
        "text_input", "cached_tokens", "pause_abort", "pause_in_place",
        "update_weights_from_disk", "flush_cache", "abort_all",
    })

    def __init__(self, url: str, session: aiohttp.ClientSession | None = None):
        self._http = HttpTransport(url, session)
        self.url = self._http.url

    async def supports_kv_transfer(self) -> bool:
        """No KV transfer, unless a driver says otherwise (`SGLangDriver` asks the engine)."""
        return False

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.close()
