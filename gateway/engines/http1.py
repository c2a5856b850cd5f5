"""A lean HTTP/1.1 client for the one request on every call's path: a streamed POST to
an engine (`/generate` and the like), over keep-alive connections.

Why not aiohttp's client, which the drivers use for everything else: its request and
response objects, tracing hooks, timers and stream reader cost about a fifth of the
gateway's whole cost per call on this path. Here a request
is its head, made by hand, and its body, written together without being joined; the
response is parsed as it arrives, in the protocol's `data_received`, into body pieces
that the caller takes straight from a list.

What it handles: `http://` and `https://` URLs (a path prefix too), status line and headers,
`Content-Length`, `Transfer-Encoding: chunked` (extensions and trailers skipped) and
bodies that end with the connection; keep-alive with reuse of idle connections,
`Connection: close`, and a request that finds its idle connection closed by the server
is sent again on another one (only if not one byte of a reply came back). A caller
that leaves a stream before its end closes the connection, as aiohttp does.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Sequence
from typing import cast
from urllib.parse import urlsplit

from undertow.gateway.engines.protocol import EngineError

__all__ = ["MAX_HEAD_BYTES", "Http1Client", "HttpError", "Response"]

MAX_HEAD_BYTES = 64 * 1024
MAX_IDLE_CONNECTIONS = 64


class HttpError(EngineError):
    """The connection failed, or the server broke HTTP/1.1 (`Http1Client.stream`)."""


class Response:
    """A response's status, headers (lower-case names) and body pieces as they come."""

    def __init__(self, connection: _Connection):
        self._connection = connection
        self.status = connection.status
        self.headers = connection.headers

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body, piece by piece as received, until its end."""
        connection = self._connection
        while True:
            if connection.pieces:
                pieces, connection.pieces = connection.pieces, []
                for piece in pieces:
                    yield piece
            elif connection.complete:
                return
            else:
                await connection.wait()

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])


class _Connection(asyncio.Protocol):
    """One TCP connection; parses one response at a time into `status`, `headers` and
    `pieces`, and wakes the reader whenever there is something new."""

    transport: asyncio.Transport  # set by `connection_made`, before `create_connection` returns

    def __init__(self) -> None:
        self.closed = False
        self.error: HttpError | None = None
        self._waiter: asyncio.Future | None = None
        self.reset()

    def reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.pieces: list[bytes] = []
        self.complete = False
        self.received = False  # a byte of this response arrived
        self.keep_alive = True
        self._buffer = bytearray()
        self.in_head = True
        self._remaining: int | None = None  # bytes left of a Content-Length body or a chunk
        self._chunked = False
        self._in_trailers = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP connection's: a stream
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            if self._remaining is None and not self._chunked and not self.in_head:
                self.complete = True  # a body that ends with the connection
            else:
                self.error = HttpError(f"connection closed mid-reply ({exc or 'by the server'})")
        self._wake()

    def data_received(self, data: bytes) -> None:
        if self.complete:  # bytes while idle: the connection is not reused
            self.keep_alive = False
            self.transport.close()
            return
        self.received = True
        try:
            self._buffer += data
            if self.in_head:
                self._parse_head()
            if not self.in_head:
                self._parse_body()
        except HttpError as error:
            self.error = error
            self.transport.close()
        self._wake()

    async def wait(self) -> None:
        """Until `data_received` or `connection_lost` has something new; raises the
        connection's error."""
        if self.error is None and not self.closed:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.error is not None:
            raise self.error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _parse_head(self) -> None:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise HttpError(f"response head over {MAX_HEAD_BYTES} bytes")
            return
        lines = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
        del self._buffer[:end + 4]
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise HttpError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self.status = int(rest[:3])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        connection = self.headers.get("connection", "").lower()
        self.keep_alive = ("close" not in connection if version == "HTTP/1.1"
                           else "keep-alive" in connection)
        if 100 <= self.status < 200:  # an interim response: the real one follows
            self.status, self.headers = 0, {}
            self._parse_head()
            return
        self.in_head = False
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._chunked = True
        elif "content-length" in self.headers:
            try:
                self._remaining = int(self.headers["content-length"])
            except ValueError:
                raise HttpError(f"bad Content-Length {self.headers['content-length']!r}") from None
        elif self.status in (204, 304):
            self._remaining = 0
        else:
            self.keep_alive = False  # the body ends with the connection

    def _parse_body(self) -> None:
        buffer = self._buffer
        if not self._chunked:
            if self._remaining is None:
                self._take(len(buffer))
            else:
                self._take(min(self._remaining, len(buffer)))
                if self._remaining == 0:
                    self._finish()
            return
        while buffer and not self.complete:
            if self._in_trailers:
                end = buffer.find(b"\r\n")
                if end < 0:
                    return
                del buffer[:end + 2]
                if end == 0:
                    self._finish()
            elif self._remaining:
                self._take(min(self._remaining, len(buffer)))
            elif self._remaining == 0:  # the CRLF after a chunk's data
                if len(buffer) < 2:
                    return
                if buffer[:2] != b"\r\n":
                    raise HttpError("chunk data not followed by CRLF")
                del buffer[:2]
                self._remaining = None
            else:
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > 1024:
                        raise HttpError("chunk size line over 1024 bytes")
                    return
                size_text = bytes(buffer[:end]).split(b";", 1)[0].strip()
                del buffer[:end + 2]
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise HttpError(f"bad chunk size {size_text[:20]!r}") from None
                if size == 0:
                    self._in_trailers = True
                else:
                    self._remaining = size

    def _take(self, num_bytes: int) -> None:
        if num_bytes:
            self.pieces.append(bytes(self._buffer[:num_bytes]))
            del self._buffer[:num_bytes]
            if self._remaining is not None:
                self._remaining -= num_bytes

    def _finish(self) -> None:
        self.complete = True
        if self._buffer:  # bytes after the end of the reply: the connection is not reused
            self.keep_alive = False


class Http1Client:
    """Streamed requests to one `http://host:port[/prefix]` over keep-alive connections.

        client = Http1Client("http://127.0.0.1:30000")
        async with client.stream("POST", "/generate", [body]) as response:
            async for piece in response.pieces(): ...
    """

    def __init__(self, url: str, connect_timeout_s: float = 10.0):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"Http1Client needs an http(s)://host[:port] URL, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self._host_header = parts.netloc.rpartition("@")[2].encode("latin-1")
        self._idle: list[_Connection] = []

    def stream(self, method: str, path: str, body: Sequence[bytes],
               headers: dict[str, str] | None = None) -> _Exchange:
        """An async context manager giving the `Response` once its head has arrived. The
        `body` is the pieces of the request's body, written as they are (not joined).
        Leaving it before the body's end closes the connection."""
        head = [f"{method} {self.prefix}{path} HTTP/1.1".encode("latin-1"),
                b"Host: " + self._host_header,
                b"Content-Length: %d" % sum(len(piece) for piece in body)]
        head += [f"{name}: {value}".encode("latin-1") for name, value in (headers or {}).items()]
        return _Exchange(self, [b"\r\n".join(head) + b"\r\n\r\n", *body])

    def close(self) -> None:
        for connection in self._idle:
            connection.transport.close()
        self._idle.clear()

    async def _send(self, request: list[bytes]) -> _Connection:
        """Writes the request on an idle connection or a new one; returns the connection
        once the response's head is in. A reused connection that the server had closed
        (no byte of a reply came back) is given up for the next one."""
        while self._idle:
            connection = self._idle.pop()
            if connection.closed:
                continue
            try:
                return await self._exchange_head(connection, request)
            except HttpError:
                if connection.received:
                    raise
        return await self._exchange_head(await self._connect(), request)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(_Connection, self.host, self.port,
                                                             ssl=self._ssl)
        except (OSError, TimeoutError) as error:
            raise HttpError(f"cannot connect to {self.host}:{self.port}: {error!r}") from None
        return connection

    @staticmethod
    async def _exchange_head(connection: _Connection, request: list[bytes]
                             ) -> _Connection:
        """Writes the request (head and body pieces, not joined); returns once the
        response's head is in (the connection is closed if that fails or is cancelled)."""
        connection.reset()
        connection.transport.writelines(request)
        try:
            while connection.in_head:
                await connection.wait()
        except BaseException:
            connection.transport.close()
            raise
        return connection

    def _release(self, connection: _Connection) -> None:
        if (connection.complete and connection.keep_alive and not connection.closed
                and len(self._idle) < MAX_IDLE_CONNECTIONS):
            self._idle.append(connection)
        elif not connection.closed:
            connection.transport.close()


class _Exchange:
    """`Http1Client.stream`'s context manager."""

    def __init__(self, client: Http1Client, request: list[bytes]):
        self._client, self._request = client, request
        self._connection: _Connection | None = None

    async def __aenter__(self) -> Response:
        self._connection = await self._client._send(self._request)
        return Response(self._connection)

    async def __aexit__(self, *exc_info) -> None:
        assert self._connection is not None, "__aenter__ set it"
        self._client._release(self._connection)
