"""`undertow export predictions|sft` and `undertow sft --data`: what a run gives away."""

import json
import subprocess
import sys

import pytest

from undertow.cli import main
from undertow.exports import read_sft_trees, sft_records
from undertow.gateway.trees.tree import Tree
from undertow.learner.trees import load_store_trees

GOLD = "diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x\n+y\n"


def _session(instance_id, index, reward, diff):
    return {"instance_id": instance_id, "index": index, "session_id": f"{instance_id}-{index}",
            "reward": reward, "resolved": reward == 1.0, "details": {"diff": diff}}


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "rollouts" / "rollout-1"
    run.mkdir(parents=True)
    sessions = [_session("t-1", 0, 0.0, ""), _session("t-1", 1, 1.0, GOLD),
                _session("t-2", 0, 0.5, "diff --git a/b.py b/b.py\n"),
                _session("t-2", 1, 0.5, "diff --git a/c.py b/c.py\n"),
                {"instance_id": "t-3", "index": 0, "session_id": "", "reward": 0.0}]
    (run / "summary.json").write_text(json.dumps({"scaffold": "command", "sessions": sessions}))
    store = run / "gateway" / "store"
    store.mkdir(parents=True)
    tree = Tree("t-1")
    events = [tree.add_call("c1", "s-a", [1, 2, 3], [10, 11], [-0.1, -0.2], [0, 0]).to_json(),
              tree.add_call("c2", "s-a", [1, 2, 3, 10, 11, 4], [12], [-0.3], [1]).to_json(),
              tree.add_call("c3", "s-b", [1, 2, 3], [13], [-0.4], [0]).to_json(),
              tree.add_call("c4", "s-c", [1, 2], [14], [-0.5], [0]).to_json()]
    events += [{"kind": "session_close", "session_id": "s-a", "reward": 1.0,
                "meta": {"instance_id": "t-1"}},
               {"kind": "session_close", "session_id": "s-b", "reward": 0.0,
                "meta": {"instance_id": "t-1"}}]
    (store / "t-1.jsonl").write_text("".join(json.dumps(event) + "\n" for event in events))
    return run


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_predictions_best_of_group_and_per_session(run_dir, tmp_path, capsys):
    out = tmp_path / "preds.jsonl"
    assert main(["export", "predictions", str(run_dir), "--out", str(out)]) == 0
    assert _read(out) == [
        {"instance_id": "t-1", "model_name_or_path": "undertow-command", "model_patch": GOLD},
        {"instance_id": "t-2", "model_name_or_path": "undertow-command",
         "model_patch": "diff --git a/b.py b/b.py\n"}]
    assert "wrote 2 predictions from 4 sessions" in capsys.readouterr().out
    assert main(["export", "predictions", str(run_dir), "--out", str(out), "--select", "all",
                 "--model-name", "m"]) == 0
    rows = _read(out)
    assert [(r["session_id"], r["reward"], r["model_name_or_path"]) for r in rows] == [
        ("t-1-0", 0.0, "m"), ("t-1-1", 1.0, "m"), ("t-2-0", 0.5, "m"), ("t-2-1", 0.5, "m")]


def _diff_with_artefacts(repo) -> tuple[str, str]:
    """A real git diff of an agent's work after it ran its code and tests without
    PYTHONDONTWRITEBYTECODE: a changed and a new module, their bytecode, pytest's cache, an
    egg-info folder, and a tracked .pyc (the base commit has it) rewritten; and the diff
    of the source changes alone (the tracked .pyc's change is one of them)."""
    git = {"cwd": repo, "check": True, "capture_output": True, "text": True}
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "mod.py").write_text("x = 1\n")
    (repo / "vendored").mkdir()
    (repo / "vendored" / "blob.pyc").write_bytes(b"\x00old")
    subprocess.run(["git", "init", "-q"], **git)
    subprocess.run(["git", "add", "-A"], **git)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"],
                   **git)
    (repo / "pkg" / "mod.py").write_text("x = 2\n")
    (repo / "pkg" / "added.py").write_text("y = 3\n")
    (repo / "vendored" / "blob.pyc").write_bytes(b"\x00new")
    subprocess.run(["git", "add", "-A"], **git)
    source_only = subprocess.run(["git", "diff", "--cached", "--binary", "HEAD"], **git).stdout
    subprocess.run([sys.executable, "-m", "compileall", "-q", "pkg"], **git)
    for folder, name in ((".pytest_cache/v/cache", "nodeids"), ("pkg.egg-info", "PKG-INFO")):
        (repo / folder).mkdir(parents=True)
        (repo / folder / name).write_text("[]\n")
    subprocess.run(["git", "add", "-A"], **git)
    recorded = subprocess.run(["git", "diff", "--cached", "--binary", "HEAD"], **git).stdout
    return recorded, source_only


def test_predictions_hold_the_agents_source_changes_only(tmp_path, capsys):
    recorded, source_only = _diff_with_artefacts(tmp_path / "repo")
    assert "__pycache__/added.cpython" in recorded and "GIT binary patch" in recorded
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(
        {"scaffold": "command", "sessions": [_session("t-1", 0, 1.0, recorded)]}))
    out = tmp_path / "preds.jsonl"
    assert main(["export", "predictions", str(run), "--out", str(out)]) == 0
    [row] = _read(out)
    assert row["model_patch"] == source_only
    assert ("4 build artefacts (bytecode, test caches) the recorded diffs added were left out"
            in capsys.readouterr().out)


def _paths(trees):
    """Each closed session's paths: token IDs, trainable flags and reward."""
    return {(tree.group_id, sid): (paths.reward, sorted(
        (tuple(tree.path_token_ids(leaf)),
         tuple(tree.nodes[n].sampled_by == sid for n in tree.path(leaf)
               for _ in tree.nodes[n].token_ids)) for leaf in paths.leaves))
        for tree in trees for sid, paths in tree.sessions.items() if paths.closed}


def test_sft_records_keep_token_ids_and_round_trip(run_dir):
    trees = load_store_trees(run_dir / "gateway" / "store")
    records = sft_records(trees, min_reward=1.0, decode=lambda ids: " ".join(map(str, ids)))
    assert [(r["session_id"], r["reward"]) for r in records] == [("s-a", 1.0)]
    record = records[0]
    assert record["token_ids"] == [1, 2, 3, 10, 11, 4, 12]
    assert record["trainable"] == [False, False, False, True, True, False, True]
    assert record["logprobs"][3:5] == [-0.1, -0.2] and record["logprobs"][0] is None
    assert record["messages"] == [
        {"role": "user", "content": "1 2 3"}, {"role": "assistant", "content": "10 11"},
        {"role": "user", "content": "4"}, {"role": "assistant", "content": "12"}]
    everything = sft_records(trees, min_reward=None)
    assert {r["session_id"] for r in everything} == {"s-a", "s-b"}


def test_export_sft_command_writes_jsonl_and_dataset_that_sft_reads_back(run_dir, tmp_path,
                                                                         tiny_model_dir, capsys):
    out = tmp_path / "sft"
    assert main(["export", "sft", str(run_dir), "--out", str(out), "--model",
                 str(tiny_model_dir), "--min-reward", "0"]) == 0
    assert "wrote 2 paths of 2 sessions (reward >= 0)" in capsys.readouterr().out
    original = _paths(load_store_trees(run_dir / "gateway" / "store"))
    assert _paths(read_sft_trees(out)) == original
    assert _paths(read_sft_trees(out / "hf")) == original
    assert all(m["content"] for r in _read(out / "sft.jsonl") for m in r["messages"])
    warm = tmp_path / "warm"
    assert main(["sft", "--data", str(out), "--model", str(tiny_model_dir), "--out", str(warm),
                 "sft.num_epochs=1"]) == 0
    assert (warm / "model.safetensors").exists()
