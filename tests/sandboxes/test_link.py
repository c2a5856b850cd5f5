"""The gateway-only network mode: from inside, the gateway answers and nothing else does."""

import json

import pytest
from aiohttp import web

from undertow.sandboxes.link import GatewayRelay, start_linked_sandbox
from undertow.sandboxes.sandbox import Sandbox, SandboxConfig

pytestmark = pytest.mark.docker

FETCH = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], data=sys.argv[2].encode() or None,
                                 timeout=5).read().decode())
except Exception as error:
    print("UNREACHABLE", type(error).__name__, error)
"""


async def _serve(name: str, host: str):
    async def answer(request: web.Request) -> web.Response:
        body = await request.text()
        return web.json_response({"server": name, "path": request.path, "body": body})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def _fetch(box: Sandbox, url: str, body: str = "") -> str:
    await box.write_file("/tmp/fetch.py", FETCH)
    result = await box.exec(f"python3 /tmp/fetch.py {url} '{body}'", timeout_s=30)
    return result.output.strip()


async def test_only_the_gateway_is_reachable(docker_connection, docker_run, fixture_image,
                                             host_bridge_ip):
    gateway, gateway_port = await _serve("gateway", "127.0.0.1")
    other, other_port = await _serve("other", "0.0.0.0")
    try:
        async with GatewayRelay("127.0.0.1", gateway_port) as link:
            box = await start_linked_sandbox(docker_connection, fixture_image, link,
                                             run=docker_run, session="linked")
            async with box:
                reply = json.loads(await _fetch(box, f"{box.gateway_url}/s/abc/v1/models"))
                assert reply == {"server": "gateway", "path": "/s/abc/v1/models", "body": ""}
                posted = json.loads(await _fetch(box, f"{box.gateway_url}/v1/x", "x" * 100000))
                assert posted["body"] == "x" * 100000
                for url in (f"http://{host_bridge_ip}:{other_port}/",
                            f"http://{host_bridge_ip}:{gateway_port}/",
                            f"http://127.0.0.1:{other_port}/", "http://10.0.0.1:80/"):
                    assert (await _fetch(box, url)).startswith("UNREACHABLE"), url
                # The relay runs as root: the agent's user can neither kill nor replace it.
                relay = await box.exec("pkill -f '[i]mport asyncio, sys'", timeout_s=30)
                assert "Operation not permitted" in relay.output
                still = json.loads(await _fetch(box, f"{box.gateway_url}/again"))
                assert still["path"] == "/again"
        # Control: the other server is reachable from a bridged container, so the checks
        # above would have seen it if the linked sandbox could reach it.
        async with await Sandbox.start(docker_connection, fixture_image, run=docker_run,
                                       session="bridged",
                                       config=SandboxConfig(network="bridge")) as bridged:
            reply = json.loads(await _fetch(bridged, f"http://{host_bridge_ip}:{other_port}/"))
            assert reply["server"] == "other"
    finally:
        await gateway.cleanup()
        await other.cleanup()
