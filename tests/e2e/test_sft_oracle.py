"""`undertow sft-collect` end to end: the replay engine serves a task's oracle turns, the
real mini-swe-agent runs them in a Docker sandbox through the real gateway, and the tree
store then holds exactly the oracle's token IDs as sampled tokens, in a session graded 1.
"""

import pytest

from tests.adapters.conftest import BUNDLED, run_containers
from undertow.learner.trees import load_store_trees
from undertow.sandboxes.task import load_tasks
from undertow.sft_collect import CollectCommand, collect, oracle_scripts

pytestmark = pytest.mark.asyncio(loop_scope="session")

TASK = "inilike__inilike-14"


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.agents
async def test_collecting_one_task_stores_the_oracle_tokens_with_reward_1(
        tiny_model_dir, tmp_path):
    tasks = [t for t in load_tasks(BUNDLED) if t.instance_id == TASK]
    command = CollectCommand(tasks=BUNDLED, out=tmp_path / "store", model_dir=tiny_model_dir,
                             logs_dir=tmp_path / "logs", concurrency=1, timeout_s=180,
                             progress_interval_s=0)
    summary = await collect(command, tasks)

    [result] = summary.sessions
    assert (result.cause, result.resolved, result.reward) == ("exited", True, 1.0), result
    assert result.details["exit_status"] == "Submitted", result.log_tail
    assert run_containers(summary.run_id) == []
    [tree] = load_store_trees(command.out)
    [(session_id, paths)] = tree.sessions.items()
    assert paths.closed and paths.reward == 1.0
    [script] = oracle_scripts(tasks, tiny_model_dir)
    sampled = [tree.path_token_ids(call.leaf)[-call.num_completion_tokens:]
               for call in tree.calls if call.session_id == session_id]
    assert sampled == [list(turn) for turn in script.turns]
    trainable = [n.token_ids for n in tree.nodes.values() if n.trainable]
    assert trainable == sampled  # the sampled tokens are the tree's only trainable ones
