"""What the viewer's pages are made of (`undertow/ui/runs.py`, `views.py`), without a
browser: a store written by the gateway's own `TreeStore` from `Tree.add_call` records,
with a history rewrite and a retry branch, and run folders with parts missing."""

import asyncio
import json
from pathlib import Path

import pytest

from undertow.gateway.front.store import TreeStore
from undertow.gateway.trees.tree import Tree
from undertow.learner.trackers import newest_groups
from undertow.ui import runs as ui_runs
from undertow.ui import views
from undertow.ui.runs import Catalog, NotFoundError, RunFolder

GROUP = "g000000-r0"


async def _write(store_dir: Path, tree: Tree, records: list, closes: dict) -> None:
    store = TreeStore(store_dir)
    await store.start()
    for record in records:
        await store.append(tree.group_id, record.to_json())
    for session, (reward, meta) in closes.items():
        await store.append(tree.group_id, {"kind": "session_close", "session_id": session,
                                           "reward": reward, "meta": meta})
    await store.close()


@pytest.fixture
def run(tmp_path) -> RunFolder:
    """Session `a`: three calls, the third rewriting the history (drops the second reply)
    and marked `rewrite` by the gateway's branch label; session `b`: one call, a retry."""
    tree = Tree(GROUP)
    records = [
        tree.add_call("a0", "a", [1, 2, 3], [10, 11], [-0.1, -0.2], [0, 0]),
        tree.add_call("a1", "a", [1, 2, 3, 10, 11, 4], [12, 13], [-0.3, -0.4], [0, 1]),
        tree.add_call("a2", "a", [1, 2, 3, 10, 11, 5], [14], [-0.5], [1], branch="rewrite"),
        tree.add_call("b0", "b", [1, 2, 3], [20, 21, 22], [-1.0, -2.0, -3.0], [1, 1, 1],
                      branch="retry"),
    ]
    closes = {"a": (1.0, {"cause": "exited", "duration_s": 12.5, "tests": {"t1": "PASSED"},
                          "details": {"diff": "+fixed\n-broken"}}),
              "b": (0.0, {"cause": "timeout", "duration_s": 30.0})}
    asyncio.run(_write(tmp_path / "run" / "store", tree, records, closes))
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5,
                                                                "step_s": 2.0,
                                                                "num_trained_tokens": 8}) + "\n")
    return RunFolder("run", tmp_path / "run")


def test_session_view_gives_each_calls_new_tokens_and_reply(run):
    view = views.session_view(run, GROUP, "a")
    assert view["num_calls"] == 3 and view["reward"] == 1.0
    assert view["outcome"]["tests"] == {"t1": "PASSED"} and view["diff"] == "+fixed\n-broken"
    first, second, third = view["calls"]
    assert (first["num_prompt_tokens"], first["num_new_prompt_tokens"]) == (3, 3)
    assert second["num_new_prompt_tokens"] == 1   # token 4, after the first call's reply
    assert third["num_new_prompt_tokens"] == 1    # token 5: the rewrite dropped reply 12 13
    assert second["reply"]["token_ids"] == [12, 13]
    assert second["reply"]["logprobs"] == [-0.3, -0.4]
    assert second["reply"]["weight_versions"] == [0, 1]
    assert second["labels"] == ["weights changed mid-reply: v0 → v1"]
    assert third["labels"] == ["rewrite"] and first["labels"] == []
    assert second["prompt_text"] == "<4>"   # no tokenizer in this run: IDs stand in
    assert not view["decoded"]


def _reference_new_prompt_tokens(tree: Tree, session_id: str) -> int:
    """From the tree's token IDs, not its nodes: each call's prompt tokens past the longest
    prefix it shares with the session's previous call's tokens, summed over the calls."""
    total, previous = 0, []
    for call in [c for c in tree.calls if c.session_id == session_id]:
        token_ids = tree.path_token_ids(call.leaf)
        prompt = token_ids[:len(token_ids) - call.num_completion_tokens]
        num_shared = next((i for i, (a, b) in enumerate(zip(prompt, previous, strict=False))
                           if a != b), min(len(prompt), len(previous)))
        total += len(prompt) - num_shared
        previous = token_ids
    return total


def test_step_and_session_pages_count_the_same_new_prompt_tokens(run):
    """Session `b` sends the prompt `a` already put in the tree: the tree stores no new
    token for it (`Call.num_prompt_tokens` 0), but its call sent 3 prompt tokens new to
    the session, which its session page shows; the step page now says the same."""
    tree = run.tree(GROUP)
    (group,) = views.step_view(run, 1)["groups"]
    rows = {row["session"]: row for row in group["sessions"]}
    for session_id in ("a", "b"):
        calls = views.session_view(run, GROUP, session_id)["calls"]
        on_session_page = sum(c["num_new_prompt_tokens"] for c in calls)
        assert rows[session_id]["num_new_prompt_tokens"] == on_session_page
        assert on_session_page == _reference_new_prompt_tokens(tree, session_id)
    assert (rows["a"]["num_new_prompt_tokens"], rows["b"]["num_new_prompt_tokens"]) == (5, 3)


def test_session_pages(run):
    page = views.session_view(run, GROUP, "a", offset=2, limit=10)
    assert [c["index"] for c in page["calls"]] == [2]
    assert page["calls"][0]["reply"]["token_ids"] == [14]


def test_step_view_lists_sessions_with_advantages(run):
    step = views.step_view(run, 1)
    assert step["groups_source"] == "inferred"   # no steps.jsonl: launch order
    (group,) = step["groups"]
    rows = {row["session"]: row for row in group["sessions"]}
    assert rows["a"]["advantage"] == pytest.approx(1.0, abs=1e-4)
    assert rows["b"]["advantage"] == pytest.approx(-1.0, abs=1e-4)
    assert rows["b"]["cause"] == "timeout" and rows["a"]["duration_s"] == 12.5
    assert rows["a"]["num_calls"] == 3 and rows["a"]["num_completion_tokens"] == 5
    assert step["metrics"]["tokens_per_s"] == 4.0


def test_step_view_prefers_recorded_groups(run):
    (run.path / "steps.jsonl").write_text(
        json.dumps({"step": 1, "indices": [9], "group_ids": []}) + "\n"
        + json.dumps({"step": 1, "indices": [0], "group_ids": []}) + "\n")  # after a resume
    step = views.step_view(run, 1)
    assert step["groups_source"] == "recorded" and [g["group"] for g in step["groups"]] == [GROUP]


def test_launch_indices_name_the_newest_group_with_any_instance_suffix(tmp_path):
    for name in ("g000000-r0.calclang__calclang-2", "g000000-r1.calclang__calclang-2",
                 "g000001-r0", "notes"):
        (tmp_path / f"{name}.jsonl").write_text("")
    assert newest_groups(tmp_path) == {0: "g000000-r1.calclang__calclang-2", 1: "g000001-r0"}


def test_tree_view_has_every_node_with_its_owner_and_sessions(run):
    tree = run.tree(GROUP)
    view = views.tree_view(run, GROUP)
    assert len(view["nodes"]) == len(tree.nodes) - 1
    shared = [n for n in view["nodes"] if n["sampled_by"] is None and len(n["sessions"]) == 2]
    assert [n["num_tokens"] for n in shared] == [3]   # the prompt both sessions share
    owners = {n["sampled_by"] for n in view["nodes"] if n["sampled_by"]}
    assert owners == {"a", "b"}


def test_unknown_names_are_not_found(run):
    with pytest.raises(NotFoundError, match="no session 'zz'"):
        views.session_view(run, GROUP, "zz")
    with pytest.raises(NotFoundError, match="no group"):
        run.tree("g999999-r0")
    with pytest.raises(NotFoundError, match="no step 7"):
        views.step_view(run, 7)


def test_half_written_and_missing_runs_say_what_is_missing(tmp_path):
    runs = tmp_path / "runs"
    (runs / "torn").mkdir(parents=True)
    (runs / "torn" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')
    (runs / "not-a-run").mkdir()
    catalog = Catalog(runs)
    assert sorted(catalog.runs) == ["torn"]
    summary = catalog.run("torn").summary()
    assert summary["num_steps"] == 1
    problems = " | ".join(summary["problems"])
    assert "cut off" in problems and "no checkpoint" in problems and "no tree store" in problems
    assert Catalog(tmp_path / "nowhere").problems() == [f"{tmp_path / 'nowhere'} does not exist"]
    assert "holds no run" in Catalog(runs / "not-a-run").problems()[0]


BAD_METRICS = (
    '{"step": 1, "loss": 0.5, "step_s": 2.0, "num_trained_tokens": 8}\n'
    "null\n"
    "[1,2,3]\n"
    '{"step": 2, "lo\n'                                   # damaged in the middle
    '{"step": "three", "loss": 0.1}\n'
    '{"step": 3, "loss": "n/a", "new_metric": {"from": "another part"}}\n'
    '{"step": 4, "los')                                     # cut off: the file ends here


def test_each_bad_metrics_line_is_named_with_its_line_and_the_rest_is_shown(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(BAD_METRICS)
    run = RunFolder("run", tmp_path / "run")
    records, problems = run.metrics()
    assert [r["step"] for r in records] == [1, 3]
    assert records[0]["tokens_per_s"] == 4.0 and "tokens_per_s" not in records[1]
    assert records[1]["new_metric"] == {"from": "another part"}
    assert problems == [
        "metrics.jsonl line 2 holds null, not a record (a JSON object); it is skipped",
        "metrics.jsonl line 3 holds a list, not a record (a JSON object); it is skipped",
        "metrics.jsonl line 4 is damaged (not JSON: Unterminated string starting at "
        "column 13); it is skipped",
        'metrics.jsonl line 5 has no step number ("step" is "three", not an integer); '
        "it is skipped",
        "metrics.jsonl line 7 is cut off (the file ends mid-line: written while the run "
        "stopped, or still being written); it is skipped"]
    summary = run.summary()
    assert summary["num_steps"] == 2 and set(problems) <= set(summary["problems"])
    assert views.step_view(run, 3)["metrics"]["loss"] == "n/a"


def test_a_file_of_bad_lines_names_a_few_and_counts_the_rest(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text("7\n" * 12 + '{"step": 1}\n')
    records, problems = ui_runs.read_jsonl(path, "steps.jsonl")
    assert records == [{"step": 1}]
    assert len(problems) == ui_runs.MAX_LINE_PROBLEMS + 1
    assert problems[0] == ("steps.jsonl line 1 holds a number, not a record (a JSON object); "
                           "it is skipped")
    assert problems[-1] == f"steps.jsonl: {12 - ui_runs.MAX_LINE_PROBLEMS} more bad lines"


async def _get(runs_dir: Path, *paths: str) -> list[tuple[int, dict]]:
    from aiohttp.test_utils import TestClient, TestServer

    from undertow.ui.server import Viewer, ViewerConfig

    async with TestClient(TestServer(Viewer(ViewerConfig(runs_dir=runs_dir)).app())) as client:
        answers = []
        for path in paths:
            reply = await client.get(path)
            answers.append((reply.status, await reply.json()))
        return answers


async def test_the_server_lists_every_run_when_one_has_bad_records(run, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "good").symlink_to(run.path)
    (runs / "bad").mkdir()
    (runs / "bad" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.25}\nnull\n[1,2,3]\n')
    (listed, listed_status), (one, one_status) = [
        (body, status) for status, body in await _get(runs, "/api/runs", "/api/runs/bad")]
    assert (listed_status, one_status) == (200, 200)
    by_name = {r["name"]: r for r in listed["runs"]}
    assert sorted(by_name) == ["bad", "good"] and by_name["good"]["num_steps"] == 1
    assert by_name["bad"]["num_steps"] == 1
    assert [p for p in one["problems"] if "metrics.jsonl" in p] == [
        "metrics.jsonl line 2 holds null, not a record (a JSON object); it is skipped",
        "metrics.jsonl line 3 holds a list, not a record (a JSON object); it is skipped"]
    assert one["metrics"] == [{"step": 1, "loss": 0.25}]


async def test_a_run_the_viewer_cannot_read_is_listed_with_why(run, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "good").symlink_to(run.path)
    checkpoint = runs / "odd" / "checkpoints" / "step-000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.yaml").write_text("learner: [1, 2]\n")   # a section that is a list
    [(status, listed)] = await _get(runs, "/api/runs")
    by_name = {r["name"]: r for r in listed["runs"]}
    assert status == 200 and by_name["good"]["num_steps"] == 1
    assert by_name["odd"]["status"] == "unreadable"
    assert by_name["odd"]["problems"][0].startswith(
        "the viewer could not read this run (AttributeError:")


async def test_a_failure_the_viewer_did_not_foresee_answers_json(run, tmp_path):
    (run.store_dir / f"{GROUP}.jsonl").write_text('{"kind": "call"}\n{"kind": "nonsense"}\n')
    [(status, body)] = await _get(run.path, f"/api/runs/run/groups/{GROUP}/tree")
    assert status == 500
    assert body["error"].startswith(f"the viewer failed on /api/runs/run/groups/{GROUP}/tree:")


def test_a_store_alone_is_shown_as_a_run(run, tmp_path):
    catalog = Catalog(tmp_path / "empty-runs", store_dir=run.store_dir)
    store = catalog.run("store")
    assert store.groups() == [GROUP] and store.status(0) == "store"
    assert store.problems() == []


def test_scaffold_messages_come_from_its_trajectory_file(run):
    folder = run.path / "rollouts" / GROUP / "sessions" / "a"
    folder.mkdir(parents=True)
    (folder / "trajectory.json").write_text(json.dumps({"info": {}, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Fix it."}]}]}))
    view = views.session_view(run, GROUP, "a")
    assert view["scaffold_messages"] == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Fix it."}]
    assert views.session_view(run, GROUP, "b")["scaffold_messages"] == []


def test_a_live_gateway_needs_the_admin_token(tmp_path):
    from undertow.ui.server import ViewerConfig

    with pytest.raises(ValueError, match="UNDERTOW_ADMIN_TOKEN"):
        ViewerConfig(runs_dir=tmp_path, gateway_url="http://127.0.0.1:9")
    assert ViewerConfig(runs_dir=tmp_path, gateway_url="http://127.0.0.1:9",
                        admin_token="t").admin_token == "t"
