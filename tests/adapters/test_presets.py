"""Claude Code, Codex CLI (npm packages) and OpenHands (PyPI) run against the gateway
through their presets.

They run on the host (`where="host"`): the check is that each real CLI reaches the
session's gateway endpoint with the API it speaks (Claude Code: Anthropic Messages at
`ANTHROPIC_BASE_URL`, print mode; Codex: the Responses API through a custom model
provider), and that its calls land in the session's tree. The scripted engine answers
with plain text, which each CLI prints before exiting. Install them with
`npm install --prefix .cache/agents @anthropic-ai/claude-code @openai/codex`; the tests
skip when a CLI is absent.

OpenHands (`make setup-openhands`: its own Python 3.12 virtualenv `.venv-openhands`)
speaks Chat Completions through litellm with its `cli` runtime; to each plain-text reply
it answers "continue" until its iteration limit (2 here), then exits; its events are
logged, the replies included. It skips when the virtualenv is absent.
"""

import os
import shutil
from functools import partial

import pytest

from undertow.adapters.configs.presets import claude_code, codex, openhands
from undertow.adapters.rollout import Rollout, RolloutConfig

from .conftest import REPO, run_containers

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the fixtures' loop


def find_cli(name: str) -> str | None:
    local = REPO / ".cache" / "agents" / "node_modules" / ".bin" / name
    return str(local) if local.exists() else shutil.which(name)


def find_program(name: str) -> str | None:
    if name == "openhands":
        python = REPO / ".venv-openhands" / "bin" / "python"
        return f"{python} -m openhands.core.main" if python.exists() else None
    return find_cli(name)


@pytest.mark.docker
@pytest.mark.agents
@pytest.mark.parametrize("preset,program", [(claude_code, "claude"), (codex, "codex"),
                                            (partial(openhands, max_iterations=2), "openhands")],
                         ids=["claude-code", "codex", "openhands"])
async def test_cli_talks_to_the_gateway(preset, program, scripted_gateway, bundled_tasks,
                                        connection, tmp_path):
    path = find_program(program)
    if path is None:
        pytest.skip(f"{program} is not installed (make setup-agents / make setup-openhands)")
    os.environ.setdefault("HOME", str(tmp_path))
    scaffold = preset(where="host", program=path)
    task = bundled_tasks["calclang__calclang-2"]
    config = RolloutConfig(timeout_s=120, out_dir=tmp_path, progress_interval_s=0)
    rollout = Rollout([task], scaffold, scripted_gateway.admin, connection, config)
    [result] = (await rollout.run()).sessions

    assert result.num_calls >= 1, (result.cause, result.log_tail)
    assert "No tool call here." in result.log_tail, result.log_tail
    assert result.cause == "exited", result.log_tail
    assert run_containers(rollout.run_id) == []
