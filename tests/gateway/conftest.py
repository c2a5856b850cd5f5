"""Fixtures for gateway tests: a gateway (in this process, real aiohttp server on port
0) in front of either the scripted engine (`scripted_engine.py`, a real SGLang-protocol
server replaying token IDs) or the real built-in engine (a subprocess on the tiny
model), with helpers to open sessions and read trees through the admin API."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.engines.conftest import start_builtin_engine
from tests.gateway.scripted_engine import ScriptedEngine
from undertow.gateway.front.app import STORE_KEY, create_app
from undertow.gateway.front.config import GatewayConfig
from undertow.gateway.render import Renderer

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
ADMIN_TOKEN = "test-admin-token"


@dataclass
class Gateway:
    url: str
    app: web.Application
    store_dir: Path
    http: aiohttp.ClientSession

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def open_session(self, group: str = "g", **extra) -> dict:
        async with self.http.post(f"{self.url}/admin/sessions", json={"group": group, **extra},
                                  headers=self.admin) as reply:
            assert reply.status == 201, await reply.text()
            return await reply.json()

    async def session_tree(self, session_id: str) -> dict:
        async with self.http.get(f"{self.url}/admin/sessions/{session_id}/tree",
                                 headers=self.admin) as reply:
            assert reply.status == 200, await reply.text()
            return await reply.json()

    def tree(self, group: str = "g"):
        return self.app[STORE_KEY].tree(group)


async def start_gateway(engine_urls, model_dir: Path, store_dir: Path, **config) -> tuple:
    app = create_app(GatewayConfig(model_dir=model_dir, store_dir=store_dir,
                                   engine_urls=tuple(engine_urls), admin_token=ADMIN_TOKEN,
                                   **config))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return app, runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture(scope="session")
def renderer(tiny_model_dir) -> Renderer:
    return Renderer(tiny_model_dir)


@pytest.fixture
async def scripted(renderer):
    """The scripted engine, served on a free port; `.url` is its address."""
    engine = ScriptedEngine(default=renderer.encode("Hello from the script.") + [2],
                            stop_token_ids=(2,))
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield engine
    await runner.cleanup()


@pytest.fixture
async def make_gateway(tiny_model_dir, tmp_path):
    """`await make_gateway(engine_urls, **config)` starts a gateway; all stop at teardown."""
    runners, sessions = [], []

    async def make(engine_urls, store_dir: Path | None = None, **config) -> Gateway:
        store_dir = store_dir or tmp_path / f"store{len(runners)}"
        app, runner, url = await start_gateway(engine_urls, tiny_model_dir, store_dir, **config)
        runners.append(runner)
        http = aiohttp.ClientSession()
        sessions.append(http)
        return Gateway(url, app, store_dir, http)

    yield make
    for http in sessions:
        await http.close()
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def gateway(make_gateway, scripted) -> Gateway:
    """A gateway in front of the scripted engine."""
    return await make_gateway([scripted.url])


@pytest.fixture(scope="session")
def engine_url(tiny_model_dir):
    """A real built-in engine on the tiny model for the whole test session."""
    with start_builtin_engine(tiny_model_dir) as url:
        yield url
