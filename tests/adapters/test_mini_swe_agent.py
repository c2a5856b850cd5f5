"""The real mini-swe-agent, unmodified, driven through the gateway into a sandbox.

A scripted model at the engine edge replays the token IDs of an oracle trajectory
(read a file, apply the gold patch with a heredoc, submit the way mini-swe-agent 2.4
expects): the session must be graded 1, and the tree must hold exactly those IDs.
"""

import json

import pytest

from undertow.adapters.mini_swe_agent import MiniSweAgent
from undertow.adapters.rollout import Rollout, RolloutConfig
from undertow.adapters.summary import SessionResult

from .conftest import run_containers

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the fixtures' loop

TASK = "calclang__calclang-2"


def oracle_turns(task) -> list[str]:
    """The assistant turns of a trajectory that solves `task` (tool calls in the built-in
    model's `<tool_call>` format)."""
    commands = [
        "grep -n 'def power' -A 5 calclang/parser.py",
        f"git apply <<'UNDERTOW_PATCH'\n{task.patch}UNDERTOW_PATCH",
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff",
    ]
    thoughts = ["THOUGHT: Let me look at how powers are parsed.",
                "THOUGHT: `**` must be right-associative and take a unary exponent.",
                "THOUGHT: The fix is in place; submitting."]
    return [f"{thought}\n\n<tool_call>\n"
            f"{json.dumps({'name': 'bash', 'arguments': {'command': command}})}\n</tool_call>"
            for thought, command in zip(thoughts, commands, strict=True)]


@pytest.mark.docker
@pytest.mark.agents
async def test_oracle_trajectory_through_mini_swe_agent_scores_1(
        scripted_gateway, bundled_tasks, connection, tmp_path):
    task = bundled_tasks[TASK]
    engine = scripted_gateway.engine
    stop_id = min(engine.stop_token_ids)
    scripts = [engine.renderer.encode(turn) + [stop_id] for turn in oracle_turns(task)]
    engine.scripts = [list(script) for script in scripts]
    config = RolloutConfig(group_size=1, concurrency=1, timeout_s=300, out_dir=tmp_path,
                           progress_interval_s=0)
    rollout = Rollout([task], MiniSweAgent(step_limit=6), scripted_gateway.admin, connection,
                      config)
    summary = await rollout.run()

    [result] = summary.sessions
    assert isinstance(result, SessionResult)
    assert result.details.get("exit_status") == "Submitted", (result.error, result.log_tail)
    assert (result.cause, result.reward, result.resolved) == ("exited", 1.0, True), result
    assert "return ast.Binary(token.line, \"**\", base, self.unary())" in result.details["diff"]
    session = await scripted_gateway.admin.session(result.session_id)
    assert session["closed"] and session["reward"] == 1.0
    assert session["meta"]["cause"] == "exited"
    tree = await scripted_gateway.admin.session_tree(result.session_id)
    assert len(tree["calls"]) == 3
    sampled = [node["token_ids"] for node in tree["nodes"] if node["trainable"]]
    assert sampled == scripts  # exactly the IDs the engine sent, one node per reply
    assert run_containers(rollout.run_id) == []
