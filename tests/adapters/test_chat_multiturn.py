"""Multi-turn lookup sessions through a real gateway (scripted engine): two calls a
session, the second call's prompt holding the tool's answer to the first (or not, with
`drop_tool_result`), the reward paid only for the value drawn for the session."""

from __future__ import annotations

import pytest

from undertow.adapters.chat_multiturn import (
    NO_SUCH_KEY,
    ChatMultiturnConfig,
    ChatMultiturnRollout,
    session_value,
    tool_result,
)
from undertow.adapters.chat_rollout import PromptTask
from undertow.adapters.errors import RolloutError
from undertow.gateway.trees.tree import tree_from_json

ASYNC = pytest.mark.asyncio(loop_scope="session")  # the fixtures' loop

QUESTION = "What is the value of apple?"


def _task(**fields) -> PromptTask:
    row = {"instance_id": "lookup-apple", "key": "apple",
           "reward": "undertow.adapters.rewards:exact_answer", **fields}
    return PromptTask("lookup-apple", ({"role": "user", "content": QUESTION},), row["reward"],
                      row)


def test_the_tool_answers_only_a_lookup_of_the_task_key():
    assert tool_result("lookup(apple)", "apple", 17) == "17"
    assert tool_result("Sure: lookup( 'apple' ) now", "apple", 17) == "17"
    assert tool_result("lookup(red)", "apple", 17) == NO_SUCH_KEY
    assert tool_result("apple", "apple", 17) == NO_SUCH_KEY
    config = ChatMultiturnConfig(seed=3)
    values = {session_value(config, "g", index, 0) for index in range(20)}
    assert session_value(config, "g", 4, 0) == session_value(ChatMultiturnConfig(seed=3),
                                                             "g", 4, 0)
    assert len(values) > 10 and all(10 <= v <= 99 for v in values)
    with pytest.raises(ValueError, match="min_value"):
        ChatMultiturnConfig(min_value=5, max_value=4)


def _script(gateway, replies: list[str]) -> None:
    stop = sorted(gateway.engine.renderer.stop_token_ids)[0]
    gateway.engine.scripts = [gateway.engine.renderer.encode(text) + [stop] for text in replies]


@ASYNC
@pytest.mark.parametrize("drop", [False, True], ids=["tool-result", "dropped"])
async def test_two_calls_the_second_seeing_the_value_only_through_the_tool(scripted_gateway,
                                                                         drop):
    config = ChatMultiturnConfig(group_size=2, concurrency=1, max_tokens=32, seed=5,
                                 drop_tool_result=drop)
    group = f"g-lookup-{drop}"
    values = [session_value(config, group, index, 0) for index in (0, 1)]
    # Slot 0 looks up the task's key and answers its value; slot 1 looks up another key
    # and answers that key's value from the example.
    _script(scripted_gateway, ["lookup(apple)", str(values[0]), "lookup(red)", "41"])
    results = await ChatMultiturnRollout(scripted_gateway.admin, config).run_group(
        _task(), group)
    assert sorted((r.index, r.cause, r.reward) for r in results) == [
        (0, "exited", 1.0), (1, "exited", 0.0)]
    by_index = {r.index: r for r in results}
    assert by_index[0].details["tool_result"] == str(values[0])
    assert by_index[1].details["tool_result"] == NO_SUCH_KEY

    tree = tree_from_json(await scripted_gateway.admin.group_tree(group))
    for result in results:
        assert sum(call.session_id == result.session_id for call in tree.calls) == 2
    renderer = scripted_gateway.engine.renderer
    prompts = [renderer.decode(sent.input_ids, skip_special_tokens=False)
               for sent in scripted_gateway.engine.sent.values()]
    second = prompts[1]
    assert second.startswith(prompts[0]) and "lookup(apple)" in second
    assert (str(values[0]) in second.split("lookup(apple)")[1]) is not drop


@ASYNC
async def test_a_task_without_a_key_is_refused_naming_it(scripted_gateway):
    task = PromptTask("no-key", ({"role": "user", "content": QUESTION},),
                      "undertow.adapters.rewards:exact_answer", {"instance_id": "no-key"})
    with pytest.raises(RolloutError, match=r"no-key.*'key'"):
        await ChatMultiturnRollout(scripted_gateway.admin, ChatMultiturnConfig()).run_group(
            task, "g-no-key")
