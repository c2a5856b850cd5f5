"""`undertow trees show|stats STORE` run as a command (a subprocess), on a store the
gateway wrote: a two-session group with a rewritten history (a labelled branch)."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from tests.gateway.capture import calls_of
from tests.gateway.test_api_scripted import script

pytestmark = pytest.mark.asyncio(loop_scope="session")


def undertow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "undertow.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


async def test_trees_show_and_stats_read_the_gateway_store(gateway, scripted, renderer):
    sessions = [await gateway.open_session(group="cli") for _ in range(2)]
    for session in sessions:
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
        messages = [{"role": "user", "content": "fix the bug " * 20}]
        for turn in range(3):
            script(scripted, renderer, f"step {turn}")
            reply = await client.chat.completions.create(model="m", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"result {turn}"}]
        await client.close()
    rewriter = sessions[1]
    client = openai.AsyncOpenAI(base_url=rewriter["base_url"], api_key=rewriter["api_key"])
    script(scripted, renderer, "condensed")
    await client.chat.completions.create(model="m", messages=[
        {"role": "user", "content": "summary of the work so far"}])
    await client.close()

    shown = undertow("trees", "show", str(gateway.store_dir), "--group", "cli")
    assert shown.returncode == 0, shown.stderr
    tree = gateway.tree("cli")
    assert f"group cli: 2 sessions, {len(tree.calls)} calls" in shown.stdout
    for session in sessions:
        assert f"* sampled by {session['session_id']}" in shown.stdout
    assert "branch point" in shown.stdout
    last_call = calls_of(tree, rewriter["session_id"])[-1]
    assert f"branch: call {last_call} of {rewriter['session_id']}" in shown.stdout

    one = undertow("trees", "show", str(gateway.store_dir), "--session",
                   sessions[0]["session_id"])
    assert one.returncode == 0 and sessions[1]["session_id"] not in one.stdout.split(
        "session ")[-1]

    stats = undertow("trees", "stats", str(gateway.store_dir))
    assert stats.returncode == 0, stats.stderr
    row = next(line for line in stats.stdout.splitlines() if line.startswith("| cli |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:4] == ["cli", "2", str(len(tree.calls)), str(tree.num_unique_tokens)]
    assert int(cells[4]) == tree.num_flat_tokens > tree.num_unique_tokens


async def test_trees_show_names_what_is_missing(tmp_path):
    missing = undertow("trees", "show", str(tmp_path / "nowhere"))
    assert missing.returncode != 0
    assert "no tree store" in (missing.stderr + missing.stdout)
