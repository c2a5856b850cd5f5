"""Fixtures for adapter and rollout tests: the bundled tasks, a Docker connection, and a
gateway (in this process, real aiohttp server) in front of the scripted engine
(`tests/gateway/scripted_engine.py`, a real SGLang-protocol server replaying token IDs),
reached by the code under test over HTTP only."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest
from aiohttp import web

from tests.gateway.scripted_engine import ScriptedEngine
from undertow.adapters.gateway_client import GatewayAdmin
from undertow.run.embedded import serve_gateway
from undertow.sandboxes.connection import connect
from undertow.sandboxes.sandbox import RUN_LABEL
from undertow.sandboxes.task import load_tasks

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "sandboxes" / "tasks" / "bundled"


@dataclass
class ScriptedGateway:
    engine: ScriptedEngine
    url: str
    admin: GatewayAdmin


@pytest.fixture(scope="session")
def bundled_tasks():
    return {task.instance_id: task for task in load_tasks(BUNDLED)}


@pytest.fixture
def connection():
    with connect(os.environ.get("DOCKER_HOST")) as connection:
        yield connection


def run_containers(run_id: str) -> list:
    """Containers (running or not) labelled with `run_id`."""
    client = docker.from_env()
    try:
        return client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run_id}"})
    finally:
        client.close()


async def start_scripted_engine(engine: ScriptedEngine) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def scripted_gateway(tiny_model_dir, tmp_path):
    """A gateway in front of a scripted engine whose default reply is plain text."""
    from undertow.gateway.render import Renderer

    renderer = Renderer(tiny_model_dir)
    stop_ids = tuple(sorted(renderer.stop_token_ids))
    engine = ScriptedEngine(default=renderer.encode("No tool call here.") + [stop_ids[0]],
                            stop_token_ids=stop_ids)
    engine.renderer = renderer
    runner, engine_url = await start_scripted_engine(engine)
    try:
        async with (serve_gateway(tiny_model_dir, tmp_path / "store", [engine_url]) as gateway,
                    GatewayAdmin(gateway.url, gateway.admin_token) as admin):
            yield ScriptedGateway(engine, gateway.url, admin)
    finally:
        await runner.cleanup()
