"""The gateway-only network: a scaffold inside its sandbox reaches the gateway and nothing
else, through a Unix socket relayed on both sides (docs/sandboxes.md#the-gateway-only-network).
"""

import asyncio
import contextlib
import os
import shlex
import tempfile
from pathlib import Path

from undertow.sandboxes.connection import Connection
from undertow.sandboxes.errors import SandboxError
from undertow.sandboxes.sandbox import Sandbox, SandboxConfig

SOCKET_DIR_IN_CONTAINER = "/run/undertow"
SOCKET_NAME = "gateway.sock"
_CHUNK_BYTES = 65536
_RELAY = """
import asyncio, sys
SOCKET, PORT = sys.argv[1], int(sys.argv[2])
async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        pass
async def handle(reader, writer):
    try:
        up_reader, up_writer = await asyncio.open_unix_connection(SOCKET)
    except OSError:
        writer.close()
        return
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
    writer.close()
    up_writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", PORT)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK_BYTES):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        pass


class GatewayRelay:
    """A host-side Unix socket that forwards every connection to the gateway's host and port."""

    def __init__(self, gateway_host: str, gateway_port: int):
        self.gateway_host, self.gateway_port = gateway_host, gateway_port
        self._folder = tempfile.TemporaryDirectory(prefix="undertow-link-")
        self.socket_dir = Path(self._folder.name)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> "GatewayRelay":
        path = self.socket_dir / SOCKET_NAME
        self._server = await asyncio.start_unix_server(self._forward, path=str(path))
        # The container's user (uid 1000) must be able to reach the socket.
        os.chmod(self.socket_dir, 0o755)
        os.chmod(path, 0o666)
        return self

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self.gateway_host, self.gateway_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        for stream in (writer, up_writer):
            stream.close()

    def mounts(self) -> dict:
        return {str(self.socket_dir): {"bind": SOCKET_DIR_IN_CONTAINER, "mode": "ro"}}

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        self._folder.cleanup()

    async def __aenter__(self) -> "GatewayRelay":
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def start_linked_sandbox(connection: Connection, image: str, link: GatewayRelay, *,
                               run: str, session: str, relay_port: int = 18080,
                               workdir: str = "/testbed", base_commit: str = "",
                               config: SandboxConfig | None = None) -> Sandbox:
    """Starts a sandbox whose only network peer is the gateway, at `sandbox.gateway_url`."""
    config = config or SandboxConfig()
    if config.network != "none":
        raise ValueError(f"a linked sandbox has network 'none', got {config.network!r}")
    sandbox = await Sandbox.start(connection, image, run=run, session=session, workdir=workdir,
                                  base_commit=base_commit, config=config, mounts=link.mounts())
    try:
        socket = f"{SOCKET_DIR_IN_CONTAINER}/{SOCKET_NAME}"
        await connection.call(
            connection.client.api.exec_start,
            (await connection.call(connection.client.api.exec_create, sandbox.container_id,
                                   ["python3", "-c", _RELAY, socket, str(relay_port)],
                                   user="0"))["Id"], detach=True)
        probe = ("import socket,time\nfor _ in range(100):\n  try:\n"
                 f"    socket.create_connection(('127.0.0.1', {relay_port}), 1).close(); break\n"
                 "  except OSError: time.sleep(0.05)\nelse: raise SystemExit(1)\n")
        result = await sandbox.exec(f"python3 -c {shlex.quote(probe)}", timeout_s=30)
        if result.exit_code != 0:
            raise SandboxError(f"the gateway relay did not start in {sandbox.container.short_id}: "
                               f"{result.output}; the image needs python3")
    except BaseException:
        await sandbox.close()
        raise
    sandbox.gateway_url = f"http://127.0.0.1:{relay_port}"
    return sandbox
