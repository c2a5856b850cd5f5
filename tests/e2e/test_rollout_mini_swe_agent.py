"""End to end: the built-in engine on the tiny model, the gateway, the real mini-swe-agent
and Docker sandboxes, through `undertow.run.rollout` (the command's own wiring).

The tiny model's weights are random, so mini-swe-agent gets junk: it must end by its step
limit or by repeated format errors. Every session must still end with a tree (the calls
it made), a reward, and no container left behind.
"""

import pytest

from tests.adapters.conftest import BUNDLED, run_containers
from undertow.run.rollout import RolloutCommand, run_rollout

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the fixtures' loop

TASKS = ("calclang__calclang-2", "inilike__inilike-17")


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.agents
async def test_two_tasks_two_samples_with_the_tiny_model(tiny_model_dir, tmp_path):
    command = RolloutCommand(
        tasks=BUNDLED, scaffold="mini-swe-agent", group_size=2, concurrency=2, timeout_s=300,
        model_dir=tiny_model_dir, out_dir=tmp_path, instance_ids=TASKS,
        scaffold_options={"step_limit": 2, "max_tokens": 24}, progress_interval_s=0)
    summary = await run_rollout(command)

    assert sorted(r.instance_id for r in summary.sessions) == sorted(TASKS * 2)
    for result in summary.sessions:
        assert result.closed, result
        assert result.cause == "exited", (result.cause, result.error, result.log_tail)
        assert result.details["exit_status"] in ("LimitsExceeded", "RepeatedFormatError",
                                                 "Submitted"), result.details
        assert result.num_calls >= 1 and result.num_completion_tokens >= 1
        assert 0.0 <= result.reward <= 1.0 and result.reward_source == "grade"
        assert result.grade_reason
    assert run_containers(summary.run_id) == []
    store = tmp_path / summary.run_id / "gateway" / "store"
    assert any(store.iterdir())  # the trees were written ahead to the run's store
