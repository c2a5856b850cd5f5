"""The README's "Use it with your agent", run as written.

The section's shell blocks are extracted from README.md and run by bash, in order: the
settings (prepended to each block, as a user runs them in each terminal), `undertow serve`
in the background, Codex and Claude Code (the npm CLIs of `make setup-agents`) under
auto-session keys, mini-swe-agent in a session opened and closed with `undertow session`,
and the inspection and `undertow sft`. The only change is the values of the settings'
own variables: paths under the test's folder, a free port, and `ENGINES` set to a
scripted engine served by this test (a real SGLang-protocol server at the outer edge that
remembers what it sent). The check is on the tree store read from disk: every call the
engine answered is in a tree, with exactly the prompt IDs it was sent and the token IDs
and logprobs it sent back, in the sessions the README's commands opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import sys
from pathlib import Path

import pytest
from aiohttp import web

from tests.gateway.capture import captured
from tests.gateway.scripted_engine import ScriptedEngine
from undertow.gateway.render import Renderer
from undertow.learner.trees import load_store_trees

pytestmark = pytest.mark.asyncio(loop_scope="session")
REPO = Path(__file__).resolve().parents[2]
SECTION = "## Use it with your agent"
SETTINGS = ("MODEL", "STORE", "PORT", "ENGINES")
AGENTS_BIN = REPO / ".cache" / "agents" / "node_modules" / ".bin"
REPLY = "No tool call here."


def readme_blocks() -> list[str]:
    """The ```bash blocks of the README's "Use it with your agent" section, which ends at
    the next heading of any level (outside code blocks)."""
    lines = (REPO / "README.md").read_text().splitlines(keepends=True)
    blocks, block, fenced = [], None, False
    for line in lines[lines.index(SECTION + "\n") + 1:]:
        if line.startswith("```"):
            fenced = not fenced
            if line.strip() == "```bash":
                block = []
            elif block is not None:
                blocks.append("".join(block))
                block = None
        elif block is not None:
            block.append(line)
        elif not fenced and line.startswith("#"):
            break
    return blocks


def with_values(settings: str, values: dict[str, str]) -> str:
    """The settings block with its own variables' values replaced (nothing else)."""
    line = next(line for line in settings.splitlines() if line.startswith("export "))
    names = [word.split("=", 1)[0] for word in shlex.split(line)[1:]]
    assert line.startswith("export ") and names == list(SETTINGS), line
    assignment = " ".join(f"{name}={shlex.quote(values[name])}" for name in SETTINGS)
    return settings.replace(line, f"export {assignment}", 1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def scripted_engine():
    """The scripted engine; its reply is set once the README has built the model (`reply`)."""
    engine = ScriptedEngine(default=[])
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield engine
    await runner.cleanup()


def reply_in_tokens_of(engine: ScriptedEngine, model_dir: Path) -> None:
    """Makes the engine answer REPLY in the model's own token IDs. The tiny model's
    tokenizer is trained on the project's sources, so it is the one the README's
    `undertow model init` built, not one built earlier from other sources."""
    renderer = Renderer(model_dir)
    stop_id = sorted(renderer.stop_token_ids)[0]
    engine.default, engine.stop_token_ids = renderer.encode(REPLY) + [stop_id], (stop_id,)


def shell_env(home: Path) -> dict[str, str]:
    """A new shell's: no virtualenv on the PATH (the README's settings block activates it),
    the npm CLIs first; a fresh HOME; no client variables of the caller's; litellm's bundled
    cost map (no network here)."""
    venv_bin = str(Path(sys.prefix) / "bin")
    path = os.pathsep.join([str(AGENTS_BIN), *(entry for entry in os.environ.get(
        "PATH", "").split(os.pathsep) if entry and entry != venv_bin)])
    env = {k: v for k, v in os.environ.items() if not k.startswith(
        ("OPENAI_", "ANTHROPIC_", "UNDERTOW_", "MSWEA_", "VIRTUAL_ENV"))}
    return {**env, "PATH": path, "HOME": str(home), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


async def run_block(script: str, cwd: Path, env: dict[str, str]) -> str:
    process = await asyncio.create_subprocess_exec(
        "bash", "-euo", "pipefail", "-c", script, cwd=cwd, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(process.communicate(), timeout=900)
    assert process.returncode == 0, f"{script}\n---\n{out.decode()[-4000:]}"
    return out.decode()


@contextlib.asynccontextmanager
async def serving(script: str, cwd: Path, env: dict[str, str]):
    """The serve block in the background until it prints the gateway's URL; then stopped
    with SIGTERM, as Ctrl-C would."""
    process = await asyncio.create_subprocess_exec(
        "bash", "-euo", "pipefail", "-c", script, cwd=cwd, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    lines = []
    try:
        while not any(line.startswith("next ") for line in lines):
            line = await asyncio.wait_for(process.stdout.readline(), timeout=300)
            assert line, "undertow serve ended early:\n" + "".join(lines)
            lines.append(line.decode())
        yield "".join(lines)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        await asyncio.wait_for(process.wait(), timeout=60)


def assert_trees_hold_what_the_engine_sent(store: Path, engine: ScriptedEngine) -> dict:
    """Every call recorded equals the engine's request and reply; returns the trees."""
    trees = {tree.group_id: tree for tree in load_store_trees(store)}
    recorded = {call.call_id: tree for tree in trees.values() for call in tree.calls}
    assert set(recorded) == set(engine.sent)
    for call_id, tree in recorded.items():
        got, sent = captured(tree, call_id), engine.sent[call_id]
        assert got.prompt_ids == sent.input_ids, call_id
        assert got.completion_ids == sent.output_ids, call_id
        assert got.logprobs == sent.logprobs, call_id
    return trees


@pytest.mark.slow
@pytest.mark.agents
async def test_the_readme_commands_capture_what_the_engine_sent(scripted_engine, tmp_path):
    for program in ("codex", "claude"):
        if not (AGENTS_BIN / program).exists():
            pytest.skip(f"{program} is not installed in .cache/agents (make setup-agents)")
    settings, serve, codex, claude, scored, inspect = readme_blocks()
    store, port = tmp_path / "store", free_port()
    settings = with_values(settings, {
        "MODEL": str(tmp_path / "model"), "STORE": str(store), "PORT": str(port),
        "ENGINES": f"--engine {scripted_engine.url}"})
    env, cwd = shell_env(tmp_path / "home"), tmp_path / "work"
    cwd.mkdir()
    (cwd / ".venv").symlink_to(sys.prefix)   # the folder stands in for the checkout
    (tmp_path / "home").mkdir()
    (cwd / "README.md").write_text("A smal project.\n")

    async with serving(settings + serve, cwd, env) as banner:
        assert f"gateway  http://127.0.0.1:{port}" in banner
        assert "auto-sessions on" in banner and f"undertow trees show {store}" in banner
        reply_in_tokens_of(scripted_engine, tmp_path / "model")
        codex_out = await run_block(settings + codex, cwd, env)
        claude_out = await run_block(settings + claude, cwd, env)
        await run_block(settings + scored, cwd, env)
        inspected = await run_block(settings + inspect, cwd, env)

    assert REPLY in codex_out and REPLY in claude_out
    trees = assert_trees_hold_what_the_engine_sent(store, scripted_engine)
    assert sorted(trees) == ["fix-typo", "my-agent"]
    auto_sessions = trees["my-agent"].sessions
    assert len(auto_sessions) == 2  # one per key: codex-1 and claude-1
    [(scored_id, paths)] = trees["fix-typo"].sessions.items()
    assert paths.closed and paths.reward == 1.0
    assert sum(call.session_id == scored_id for call in trees["fix-typo"].calls) >= 1
    assert not any(p.closed for p in auto_sessions.values())  # no reward: not trained

    listed = inspected.split("group fix-typo")[0]
    assert re.search(rf"{scored_id}\s+fix-typo\s+closed\s+1\s", listed), listed
    assert len(re.findall(r"\S+\s+my-agent\s+open\s", listed)) == 2, listed
    assert f"sampled by {scored_id}" in inspected
    sft_dir = cwd / "runs" / "my-agent" / "sft"
    assert inspected.strip().endswith(str(Path("runs/my-agent/sft")))
    assert (sft_dir / "config.json").exists()
    steps = [json.loads(line) for line in (sft_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps, "sft wrote no step"
