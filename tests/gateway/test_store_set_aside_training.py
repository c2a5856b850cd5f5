"""A group the store set aside (a damaged line in its file) is, for training, a group
Undertow failed: the learner's reader (`rollout_source.ThreadedGroupSource.wait` over
`learner/gateway_link.py`) gets the gateway's 503 for its tree and hands the step an empty
group whose sessions failed with `error:store`, which the step drops (counted, named in
the run's log with the file and line) and replaces; the other groups are read as the
engine sampled them. The same holds on `--resume`, when a group finished before the
crash is read back from the store."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.gateway.capture import captured
from tests.gateway.conftest import ADMIN_TOKEN, start_gateway
from tests.gateway.test_api_scripted import script
from tests.gateway.test_store_repair import admin, chat
from undertow.learner.config import AdvantageConfig
from undertow.learner.gateway_link import GatewayLink
from undertow.learner.group_filter import GroupFilter, StepCounts
from undertow.learner.run_log import RunLog
from undertow.learner.train import GroupRequest
from undertow.run.rollout_source import ThreadedGroupSource

pytestmark = pytest.mark.asyncio(loop_scope="session")
GROUP_SIZE = 2
DAMAGED, FINE = "g000000-r0", "g000001-r0"


async def write_groups(scripted, renderer, tiny_model_dir, store_dir) -> dict[str, dict]:
    """Groups DAMAGED and FINE of GROUP_SIZE one-call sessions each, closed with rewards
    0 and 1, written by an in-process gateway (stopped after). Returns each group's
    engine outputs by call ID, as the engine sampled them."""
    _, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir)
    sampled: dict[str, dict] = {DAMAGED: {}, FINE: {}}
    try:
        async with aiohttp.ClientSession() as http:
            for group in (DAMAGED, FINE):
                for reward in range(GROUP_SIZE):
                    session = await admin(http, "POST", f"{url}/admin/sessions",
                                          json={"group": group})
                    script(scripted, renderer, f"{group} answer {reward}")
                    reply = await chat(session, [{"role": "user", "content": "hi"}])
                    call_id = reply.id.removeprefix("chatcmpl-")
                    sampled[group][call_id] = list(scripted.sent[call_id].output_ids)
                    await admin(http, "POST", f"{url}/admin/sessions/"
                                f"{session['session_id']}/close", json={"reward": reward})
    finally:
        await runner.cleanup()
    return sampled


def damage(store_dir) -> None:
    """A garbage line put in DAMAGED's file, as line 3."""
    path = store_dir / f"{DAMAGED}.jsonl"
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join([*lines[:2], b'{"kind": "call", \x00 garbage', *lines[2:]]))


async def read_back(source: ThreadedGroupSource, num_groups: int) -> list:
    groups: list = []
    while len(groups) < num_groups:
        groups += await asyncio.to_thread(source.wait, 60.0)
    return sorted(groups, key=lambda group: group.index)


@pytest.mark.parametrize("num_resumes", [0, 1], ids=["run", "resume"])
async def test_a_set_aside_group_is_an_infra_failure_the_step_drops_and_names(
        scripted, renderer, tiny_model_dir, tmp_path, num_resumes):
    store_dir = tmp_path / "store"
    sampled = await write_groups(scripted, renderer, tiny_model_dir, store_dir)
    if not num_resumes:   # the damage found at start-up
        damage(store_dir)
    # A resumed gateway lists the groups of its store; it finds the damage when it loads
    # the tree back from its file (every idle tree let go).
    _, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir,
                                         store_max_idle_trees=0)
    if num_resumes:
        damage(store_dir)
    try:
        async def run_group(request) -> str:   # a fresh run's rollouts: as written above
            ran.append(request.index)
            return f"g{request.index:06d}-r0"

        ran: list[int] = []

        source = ThreadedGroupSource(asyncio.get_running_loop(), run_group,
                                     GatewayLink(url, ADMIN_TOKEN), num_resumes)
        for index in (0, 1):
            await asyncio.to_thread(source.launch, GroupRequest(
                index, f"g{index:06d}-r{num_resumes}", GROUP_SIZE, 0))
        damaged, fine = await read_back(source, 2)
        assert ran == ([] if num_resumes else [0, 1])   # a resume reads both back
    finally:
        await runner.cleanup()

    assert damaged.tree.sessions == {} and damaged.failures == {"error:store": GROUP_SIZE}
    assert f"{store_dir / DAMAGED}.jsonl line 3 is damaged" in damaged.error
    assert {call.call_id: list(captured(fine.tree, call.call_id).completion_ids)
            for call in fine.tree.calls} == sampled[FINE]

    log = RunLog(tmp_path / "run")
    admission, counts = GroupFilter(GROUP_SIZE, 3, AdvantageConfig(), log), StepCounts()
    assert admission.admit(damaged, counts, step=1) == "invalid"
    assert admission.admit(fine, counts, step=1) is None
    assert counts.metrics()["num_infra_failures"] == GROUP_SIZE
    assert counts.metrics()["infra_failures"] == {"error:store": GROUP_SIZE}
    written = log.path.read_text()
    assert f"dropped group {DAMAGED}: 0 valid session(s) left" in written
    assert f"{DAMAGED}.jsonl line 3 is damaged" in written
