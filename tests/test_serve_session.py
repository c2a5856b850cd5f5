"""`undertow session open|close|list` (`undertow/commands/session.py`), run as the real
command line against a gateway served in this process (`undertow.run.embedded`) in front
of the scripted engine: the printed environment points the real OpenAI and Anthropic
SDKs at the session, and a missing or wrong admin token names the variable to set."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
from dataclasses import dataclass

import anthropic
import openai
import pytest
from aiohttp import web

from tests.gateway.scripted_engine import ScriptedEngine
from undertow.gateway.render import Renderer
from undertow.run.embedded import serve_gateway

pytestmark = pytest.mark.asyncio(loop_scope="session")
TOKEN = "session-cli-test-token"


@dataclass
class Served:
    url: str
    engine: ScriptedEngine


@pytest.fixture
async def served(tiny_model_dir, tmp_path):
    renderer = Renderer(tiny_model_dir)
    stop_id = sorted(renderer.stop_token_ids)[0]
    engine = ScriptedEngine(default=renderer.encode("Captured.") + [stop_id],
                            stop_token_ids=(stop_id,))
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with serve_gateway(tiny_model_dir, tmp_path / "store", [engine_url],
                                 admin_token=TOKEN) as gateway:
            yield Served(gateway.url, engine)
    finally:
        await runner.cleanup()


async def undertow(*args: str, token: str | None = TOKEN) -> tuple[int, str, str]:
    """Runs `undertow ARGS` (this interpreter) with the admin token set or unset."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("UNDERTOW_ADMIN_TOKEN", "UNDERTOW_GATEWAY")}
    if token is not None:
        env["UNDERTOW_ADMIN_TOKEN"] = token
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "undertow.cli", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    return process.returncode, out.decode(), err.decode()


def exports(text: str) -> dict[str, str]:
    """The variables of `export NAME=VALUE` lines, read as a shell would."""
    pairs = [shlex.split(line.removeprefix("export "))[0] for line in text.splitlines()]
    assert all(line.startswith("export ") for line in text.splitlines()), text
    return dict(pair.split("=", 1) for pair in pairs)


async def test_open_prints_an_environment_both_sdks_use(served):
    code, out, err = await undertow("session", "open", "--gateway", served.url,
                                    "--group", "cli", "--meta", "who=test")
    assert code == 0, err
    env = exports(out)
    assert set(env) == {"OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL",
                        "ANTHROPIC_API_KEY", "UNDERTOW_SESSION"}
    chat = openai.AsyncOpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"],
                              max_retries=0)
    messages = anthropic.AsyncAnthropic(base_url=env["ANTHROPIC_BASE_URL"],
                                        api_key=env["ANTHROPIC_API_KEY"], max_retries=0)
    try:
        reply = await chat.chat.completions.create(
            model="undertow", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        message = await messages.messages.create(
            model="undertow", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    finally:
        await asyncio.gather(chat.close(), messages.close())
    assert reply.choices[0].message.content == "Captured."
    assert message.content[0].text == "Captured."

    code, out, err = await undertow("session", "list", "--gateway", served.url, "--json")
    assert code == 0, err
    [listed] = json.loads(out)
    assert listed["session_id"] == env["UNDERTOW_SESSION"]
    assert listed["num_calls"] == 2 and listed["meta"] == {"who": "test"}

    code, out, err = await undertow("session", "close", env["UNDERTOW_SESSION"], "--reward",
                                    "0.5", "--gateway", served.url)
    assert code == 0, err
    assert out.strip() == f"closed {env['UNDERTOW_SESSION']} (group cli): reward 0.5, 2 calls"
    code, out, err = await undertow("session", "list", "--gateway", served.url)
    assert code == 0, err
    header, row = out.strip().splitlines()
    assert header.split() == ["session", "group", "state", "reward", "calls", "opened", "by"]
    assert row.split() == [env["UNDERTOW_SESSION"], "cli", "closed", "0.5", "2", "admin"]


async def test_open_json_and_list_by_group(served):
    code, out, err = await undertow("session", "open", "--gateway", served.url,
                                    "--group", "one", "--json")
    assert code == 0, err
    opened = json.loads(out)
    assert opened["env"]["OPENAI_API_KEY"] == opened["api_key"]
    assert opened["env"]["OPENAI_BASE_URL"] == f"{served.url}/s/{opened['session_id']}/v1"
    assert opened["env"]["ANTHROPIC_BASE_URL"] == f"{served.url}/s/{opened['session_id']}"
    code, _, err = await undertow("session", "open", "--gateway", served.url, "--group", "two")
    assert code == 0, err
    code, out, err = await undertow("session", "list", "--gateway", served.url,
                                    "--group", "one", "--json")
    assert [s["session_id"] for s in json.loads(out)] == [opened["session_id"]]


@pytest.mark.parametrize("token", [None, "", "not-the-token"], ids=["unset", "empty", "wrong"])
async def test_a_missing_or_wrong_admin_token_names_the_variable(served, token):
    for args in (("open", "--group", "g"), ("list",), ("close", "s-x", "--reward", "1")):
        code, out, err = await undertow("session", *args, "--gateway", served.url, token=token)
        assert code == 2, (args, out, err)
        assert out == ""
        assert "UNDERTOW_ADMIN_TOKEN" in err, err
        assert ("is not set" if not token else "refused the admin token") in err, err


async def test_an_unknown_session_or_no_gateway_says_so(served, unused_tcp_port):
    code, _, err = await undertow("session", "close", "s-nothere", "--reward", "1",
                                  "--gateway", served.url)
    assert code == 2 and "404" in err and "s-nothere does not exist" in err, err
    code, _, err = await undertow("session", "list", "--gateway",
                                  f"http://127.0.0.1:{unused_tcp_port}")
    assert code == 2 and "cannot reach the gateway" in err, err
    code, _, err = await undertow("session", "list")
    assert code == 2 and "UNDERTOW_GATEWAY" in err, err
