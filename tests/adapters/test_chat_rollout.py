"""Chat rollouts on prompt tasks through a real gateway (scripted engine), with failures
of Undertow's own injected for real: a gateway that refuses to open sessions (a real
proxy in front of it with a fault switch) and a reward function that crashes. Failed
sessions must be closed as such, re-run as new sessions of the group, counted, and
left out of advantages and of the packed loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import ClientSession, web

from undertow.adapters.chat_rollout import (
    ChatRollout,
    ChatRolloutConfig,
    PromptTask,
    load_prompt_tasks,
    reward_function,
)
from undertow.adapters.errors import RolloutError
from undertow.adapters.gateway_client import GatewayAdmin
from undertow.adapters.summary import RolloutSummary
from undertow.learner.advantages import group_advantages, valid_sessions
from undertow.learner.config import AdvantageConfig
from undertow.learner.packing import pack_step

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the fixtures' loop

REPLY = "No tool call here."   # the scripted engine's reply


def crash_first(messages, task):
    """Raises on the first call for a marker file (then creates it), scores after."""
    marker = Path(task["marker"])
    if not marker.exists():
        marker.write_text("crashed once")
        raise RuntimeError("the grader crashed")
    return messages[-1]["content"] == REPLY


class RefusingProxy:
    """A real HTTP proxy in front of the gateway that answers 503 to the first
    `num_refusals` session opens (`POST /admin/sessions`) and forwards the rest."""

    def __init__(self, upstream: str, num_refusals: int):
        self.upstream, self.num_refusals = upstream, num_refusals
        self.num_refused = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "POST" and request.path == "/admin/sessions" and \
                self.num_refused < self.num_refusals:
            self.num_refused += 1
            return web.json_response({"error": "no capacity"}, status=503)
        async with ClientSession() as http, http.request(
                request.method, self.upstream + request.path_qs, data=await request.read(),
                headers={k: v for k, v in request.headers.items() if k.lower() != "host"}
        ) as reply:
            return web.Response(body=await reply.read(), status=reply.status,
                                content_type=reply.content_type)


@pytest.fixture
async def refusing_proxy(scripted_gateway):
    proxy = RefusingProxy(scripted_gateway.url, num_refusals=2)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield proxy, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _task(reward: str, **fields) -> PromptTask:
    row = {"instance_id": "say-it", "prompt": "Say it.", "reward": reward, **fields}
    return PromptTask("say-it", ({"role": "user", "content": "Say it."},), reward, row)


async def test_failed_sessions_are_rerun_closed_as_failures_and_never_trained(
        scripted_gateway, refusing_proxy, tmp_path):
    proxy, proxy_url = refusing_proxy
    task = _task(f"{__name__}:crash_first", marker=str(tmp_path / "crashed"))
    config = ChatRolloutConfig(group_size=3, concurrency=1, max_attempts=3)
    async with GatewayAdmin(proxy_url, scripted_gateway.admin._headers["Authorization"][7:]
                            ) as admin:
        results = await ChatRollout(admin, config).run_group(task, "g-faults")

    summary = RolloutSummary("run", "chat", 1.0, results)
    assert proxy.num_refused == 2
    assert summary.infra_failures() == {"error:open": 2, "error:reward": 1}
    assert summary.num_reruns == 3
    # Every slot ended with a real outcome, after its re-runs.
    finals = {r.index: r for r in results if not r.infra_failure}
    assert sorted(finals) == [0, 1, 2] and all(r.reward == 1.0 for r in finals.values())
    crashed = next(r for r in results if r.cause == "error:reward")
    assert "say-it" in crashed.error and "crash_first" in crashed.error

    tree = await scripted_gateway.admin.group_tree("g-faults")
    from undertow.gateway.trees.tree import tree_from_json

    tree = tree_from_json(tree)
    # The crashed session opened, called and closed: it is in the tree, marked.
    assert tree.sessions[crashed.session_id].meta["infra_failure"] is True
    assert set(valid_sessions(tree)) == {r.session_id for r in finals.values()}
    advantages = group_advantages(tree, AdvantageConfig())
    assert set(advantages) == set(valid_sessions(tree))
    step = pack_step([tree], {("g-faults", s): a for s, a in advantages.items()}, 4096)
    assert {key[1] for key in step.session_keys} == set(valid_sessions(tree))
    async with ClientSession() as http, http.get(scripted_gateway.url + "/metrics") as reply:
        metrics = await reply.text()
    assert 'undertow_sessions_closed_total{cause="error:reward",infra_failure="true"} 1' \
        in metrics


async def test_a_slot_stops_after_max_attempts(scripted_gateway, tmp_path):
    task = _task("undertow.adapters.rewards:exact_answer")   # no `answer`: KeyError
    config = ChatRolloutConfig(group_size=2, concurrency=2, max_attempts=2)
    results = await ChatRollout(scripted_gateway.admin, config).run_group(task, "g-bad")
    assert sorted((r.index, r.attempt, r.cause) for r in results) == [
        (0, 0, "error:reward"), (0, 1, "error:reward"),
        (1, 0, "error:reward"), (1, 1, "error:reward")]
    assert all("exact_answer" in r.error and "answer" in r.error for r in results)


async def test_rewards_come_from_the_named_function(scripted_gateway):
    task = _task("undertow.adapters.rewards:exact_answer", answer=REPLY.upper())
    config = ChatRolloutConfig(group_size=2, concurrency=2)
    results = await ChatRollout(scripted_gateway.admin, config).run_group(task, "g-ok")
    assert [(r.cause, r.reward, r.resolved) for r in results] == [("exited", 1.0, True)] * 2
    session = await scripted_gateway.admin.session(results[0].session_id)
    assert session["closed"] and session["reward"] == 1.0
    assert session["meta"]["details"]["reply"] == REPLY


async def test_task_sets_and_reward_names_are_checked(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"instance_id": "a", "prompt": "p", "reward": "x:y",
                                "answer": "b"}) + "\n")
    (task,) = load_prompt_tasks(path)
    assert task.fields["answer"] == "b" and task.messages[0]["content"] == "p"
    with pytest.raises(RolloutError, match=r"task a: reward function 'x:y' cannot be loaded"):
        reward_function(task)
    path.write_text(json.dumps({"instance_id": "b", "prompt": "p", "reward": "nocolon"}))
    with pytest.raises(RolloutError, match=r"task 1 \(b\).*module:function"):
        load_prompt_tasks(path)
