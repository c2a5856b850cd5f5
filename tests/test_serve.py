"""`undertow serve` and `undertow gateway serve --auto-sessions`, run as the real command
line: what they print at start-up, that a client with any key reaches the model, and
that stopping `undertow serve` (SIGTERM, as Ctrl-C) stops the built-in engine it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.gateway.scripted_engine import ScriptedEngine
from undertow.gateway.render import Renderer
from undertow.learner.trees import load_store_trees

pytestmark = pytest.mark.asyncio(loop_scope="session")


@contextlib.asynccontextmanager
async def started(*args: str, until: str, env: dict[str, str] | None = None):
    """`undertow ARGS` in the background until a printed line starts with `until`;
    yields the lines so far and the process; SIGTERM at the end."""
    environment = {k: v for k, v in os.environ.items() if k != "UNDERTOW_ADMIN_TOKEN"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "undertow.cli", *args, env={**environment, **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    lines: list[str] = []
    try:
        while not any(line.startswith(until) for line in lines):
            line = await asyncio.wait_for(process.stdout.readline(), timeout=300)
            assert line, "ended early:\n" + "".join(lines)
            lines.append(line.decode())
        yield lines, process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), timeout=60)


def field(lines: list[str], name: str) -> str:
    return next(line for line in lines if line.startswith(name + " ")).split()[1]


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
async def test_serve_starts_the_builtin_engine_and_any_key_reaches_it(tiny_model_dir,
                                                                       tmp_path):
    store = tmp_path / "run" / "store"
    async with started("serve", "--model", str(tiny_model_dir), "--store", str(store),
                       "--auto-sessions", "mine", until="next") as (lines, process):
        url = field(lines, "gateway")
        token = next(line for line in lines if line.startswith("admin ")).split(
            "UNDERTOW_ADMIN_TOKEN=")[1].split()[0]
        assert f"undertow trees show {store}" in "".join(lines)
        assert field(lines, "auto") == "auto-sessions"
        children = child_pids(process.pid)  # the built-in engine
        assert children
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="my-own-key", max_retries=0)
        try:
            reply = await client.chat.completions.create(
                model="undertow", messages=[{"role": "user", "content": "Hello"}],
                max_tokens=4, temperature=0)
        finally:
            await client.close()
        async with aiohttp.ClientSession() as http, http.get(
                f"{url}/admin/sessions", headers={"Authorization": f"Bearer {token}"}) as got:
            assert got.status == 200  # the printed token is the gateway's
            [session] = (await got.json())["sessions"]
    assert process.returncode == 0
    assert not any(alive(pid) for pid in children)
    assert (session["group"], session["auto"], session["num_calls"]) == ("mine", True, 1)
    [tree] = load_store_trees(store)
    [call] = tree.calls
    assert call.session_id == session["session_id"]
    assert call.num_completion_tokens == reply.usage.completion_tokens >= 1
    assert (tmp_path / "run" / "engine.log").exists()


def child_pids(parent: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(FileNotFoundError, IndexError, ValueError):
            if entry.name.isdigit() and int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                children.append(int(entry.name))
    return children


async def test_gateway_serve_announces_auto_sessions(tiny_model_dir, tmp_path):
    renderer = Renderer(tiny_model_dir)
    engine = ScriptedEngine(default=renderer.encode("Hi.") + [2], stop_token_ids=(2,))
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with started("gateway", "serve", "--engine", engine_url, "--model",
                           str(tiny_model_dir), "--store", str(tmp_path / "store"),
                           "--auto-sessions", "desk", "--idle-close-s", "120",
                           until="auto-sessions on") as (lines, _):
            url = lines[-2].split()[-1]
            async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as got:
                metrics = await got.text()
    finally:
        await runner.cleanup()
    assert lines[-1].strip() == ("auto-sessions on: an unknown API key opens a session in "
                                 "group 'desk' on first use (one per key); idle 120 s, it "
                                 "closes without a reward and its key opens a new session on "
                                 "its next call (reopen: expired)")
    assert 'undertow_auto_sessions_enabled{group="desk"} 1' in metrics
    assert "undertow_auto_sessions_opened_total 0" in metrics


@pytest.mark.slow
async def test_serve_a_pretrained_model_answers_as_transformers(smollm2_dir, tmp_path):
    """`undertow serve --model` on SmolLM2-135M-Instruct (its own tokenizer, its template
    in chat_template.jinja), one call from the real `openai` client: the captured prompt
    IDs are transformers' `apply_chat_template`, the completion IDs its greedy `generate`,
    and the answer text their decode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt_ids]), max_new_tokens=10,
                                  do_sample=False)[0, len(prompt_ids):].tolist()
    del model
    store = tmp_path / "store"
    async with started("serve", "--model", str(smollm2_dir), "--store", str(store),
                       "--auto-sessions", "real", until="next") as (lines, _):
        client = openai.AsyncOpenAI(base_url=f"{field(lines, 'gateway')}/v1", api_key="k",
                                    max_retries=0)
        try:
            reply = await client.chat.completions.create(
                model="undertow", messages=messages, max_tokens=10, temperature=0)
        finally:
            await client.close()
    [tree] = load_store_trees(store)
    [call] = tree.calls
    token_ids = tree.path_token_ids(call.leaf)
    assert token_ids[:call.num_prompt_tokens] == prompt_ids
    assert token_ids[call.num_prompt_tokens:] == expected
    assert reply.choices[0].message.content == tokenizer.decode(expected,
                                                                 skip_special_tokens=True)
    assert "Paris" in reply.choices[0].message.content
