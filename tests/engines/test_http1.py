"""`Http1Client`, the streamed-request client on every call's path, against a raw TCP server
that sends exactly the bytes each test names: body framings (chunked with extensions and
trailers, Content-Length, until close), replies cut into single bytes, keep-alive reuse,
and the faults (a reply broken off, a refused connection, a malformed head, an idle
connection the server closed, a caller that leaves mid-stream)."""

import asyncio

import pytest

from undertow.gateway.engines.http1 import MAX_HEAD_BYTES, Http1Client, HttpError

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHUNKED = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")


class RawServer:
    """Answers each request (head and Content-Length body) with the next of `replies`
    (bytes, or a callable taking the writer); counts connections and requests."""

    def __init__(self, *replies, close_after: bool = False, byte_by_byte: bool = False):
        self.replies = list(replies)
        self.close_after = close_after
        self.byte_by_byte = byte_by_byte
        self.num_connections = 0
        self.requests: list[bytes] = []
        self.disconnected = asyncio.Event()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc_info):
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.num_connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                if callable(reply):
                    await reply(writer)
                elif self.byte_by_byte:
                    for byte in reply:
                        writer.write(bytes([byte]))
                        await writer.drain()
                        await asyncio.sleep(0)
                else:
                    writer.write(reply)
                    await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.disconnected.set()


async def read(client: Http1Client, body: tuple[bytes, ...] = (b"{}",)) -> tuple[int, bytes]:
    async with client.stream("POST", "/generate", body, {"Content-Type": "application/json"}
                             ) as response:
        return response.status, await response.read()


async def test_a_pieced_body_and_two_chunked_replies_go_over_one_connection():
    async with RawServer(CHUNKED, CHUNKED) as server:
        client = Http1Client(server.url + "/prefix")
        assert await read(client, (b'{"a"', b": 1}")) == (200, b"hello world")
        assert await read(client) == (200, b"hello world")
        client.close()
    assert server.num_connections == 1
    assert server.requests[0].startswith(b"POST /prefix/generate HTTP/1.1\r\n")
    assert server.requests[0].endswith(b'\r\n\r\n{"a": 1}')
    assert b"Content-Length: 8\r\n" in server.requests[0]


async def test_a_reply_that_arrives_byte_by_byte_parses_the_same():
    length_reply = b"HTTP/1.1 404 Not Found\r\nContent-Length: 7\r\n\r\nmissing"
    async with RawServer(CHUNKED, length_reply, byte_by_byte=True) as server:
        client = Http1Client(server.url)
        assert await read(client) == (200, b"hello world")
        assert await read(client) == (404, b"missing")
        client.close()
    assert server.num_connections == 1


async def test_a_body_that_ends_with_the_connection_is_complete_and_not_reused():
    until_close = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"
    async with RawServer(until_close, close_after=True) as server:
        server.replies.append(until_close)
        client = Http1Client(server.url)
        assert await read(client) == (200, b"all of it")
        assert await read(client) == (200, b"all of it")
        client.close()
    assert server.num_connections == 2


async def test_an_idle_connection_the_server_closed_is_replaced_without_an_error():
    length_reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with RawServer(length_reply, length_reply, close_after=True) as server:
        client = Http1Client(server.url)
        assert await read(client) == (200, b"ok")
        await server.disconnected.wait()
        assert await read(client) == (200, b"ok")
        client.close()
    assert server.num_connections == 2


async def test_a_reply_broken_off_mid_body_raises():
    async with RawServer(CHUNKED[:60], close_after=True) as server:
        client = Http1Client(server.url)
        with pytest.raises(HttpError, match="mid-reply"):
            await read(client)
        client.close()


async def test_a_caller_that_leaves_mid_stream_closes_the_connection():
    gate = asyncio.Event()

    async def first_piece_then_wait(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await gate.wait()

    async with RawServer(first_piece_then_wait, CHUNKED) as server:
        client = Http1Client(server.url)
        async with client.stream("POST", "/generate", [b"{}"]) as response:
            async for piece in response.pieces():
                assert piece == b"abc"
                break
        gate.set()
        await asyncio.wait_for(server.disconnected.wait(), 5)
        assert await read(client) == (200, b"hello world")
        client.close()
    assert server.num_connections == 2


async def test_an_interim_100_continue_is_skipped():
    async with RawServer(b"HTTP/1.1 100 Continue\r\n\r\n" + CHUNKED) as server:
        client = Http1Client(server.url)
        assert await read(client) == (200, b"hello world")
        client.close()


@pytest.mark.parametrize("reply, message", [
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", "not followed by CRLF"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD_BYTES, "response head over"),
])
async def test_a_malformed_reply_raises_and_names_the_fault(reply, message):
    async with RawServer(reply) as server:
        client = Http1Client(server.url)
        with pytest.raises(HttpError, match=message):
            await read(client)
        client.close()


async def test_a_refused_connection_raises(unused_tcp_port):
    client = Http1Client(f"http://127.0.0.1:{unused_tcp_port}")
    with pytest.raises(HttpError, match="cannot connect"):
        await read(client)


async def test_only_http_urls_are_taken():
    with pytest.raises(ValueError, match="http"):
        Http1Client("unix:///tmp/engine.sock")
