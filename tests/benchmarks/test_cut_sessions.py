"""`python -m benchmarks.cut_sessions` on arms whose stores the gateway's own `TreeStore`
wrote: the three timeout rules on the same groups, counted by hand from sessions whose
shared prefixes are set, and the held-out points' differences."""

import asyncio
import json
from pathlib import Path

from benchmarks.cut_sessions import main
from undertow.gateway.front.store import TreeStore
from undertow.gateway.trees.tree import Tree

PROMPT = [900, 901, 902, 903]

# group: [(session, completion, graded reward, cut by its time limit)]. One call a session
# on a shared prompt, so a cut session's deepest peer is the one its completion shares
# most tokens with.
GROUPS = {
    # s1 (cut) shares [1, 2] with s0 (1.0) and nothing with s2 (0.0): its tree value is 1.
    "g-mixed": [("s0", [1, 2, 3], 1.0, False), ("s1", [1, 2, 4], 0.0, True),
                ("s2", [5, 6], 0.0, False)],
    # Only partial credit keeps a spread: the tree values s1 at s0's 1, drop leaves s0 alone.
    "g-one-left": [("s0", [1, 2], 1.0, False), ("s1", [1, 3], 0.0, True)],
    # Every session cut: the tree has no finished peer (own rewards), drop has none.
    "g-all-cut": [("s0", [1], 0.0, True), ("s1", [2], 0.0, True)],
}


async def write_store(store_dir: Path) -> None:
    store = TreeStore(store_dir)
    await store.start()
    for group_id, sessions in GROUPS.items():
        tree = Tree(group_id)
        for session_id, completion, _, _ in sessions:
            record = tree.add_call(f"{session_id}-0", session_id, PROMPT, completion,
                                   [-1.0] * len(completion), [0] * len(completion))
            await store.append(group_id, record.to_json())
        for session_id, _, reward, cut in sessions:
            await store.append(group_id, {
                "kind": "session_close", "session_id": session_id, "reward": reward,
                "meta": {"cause": "timeout" if cut else "exited"}})
    await store.close()


def write_arm(tmp_path: Path, rule: str, last_resolved: int) -> Path:
    work = tmp_path / rule
    asyncio.run(write_store(work / "train" / "store"))
    points = [(0, 30), (4, last_resolved)]
    results = {
        "args": {"work": str(work), "cut_sessions": rule, "train_timeout_s": "140.0",
                 "timeout_s": "600.0"},
        "rl": {"steps": [{"step": 1, "num_cut_sessions": 3},
                         {"step": 2, "num_cut_sessions": 1}]},
        "evaluations": [{"split": "heldout", "rl_step": step, "num_sessions": 150,
                         "num_resolved": resolved, "pass_rate": resolved / 150,
                         "interval": [0.0, 1.0]} for step, resolved in points]
        + [{"split": "heldout-seen", "rl_step": 0, "num_sessions": 32, "num_resolved": 1,
            "pass_rate": 1 / 32, "interval": [0.0, 1.0]}]}
    path = tmp_path / f"{rule}.json"
    path.write_text(json.dumps(results))
    return path


def test_three_rules_on_the_same_trees_and_each_arms_points(tmp_path, monkeypatch, capsys):
    arms = [write_arm(tmp_path, "tree_value", 60), write_arm(tmp_path, "drop", 45)]
    out = tmp_path / "cut_sessions.json"
    monkeypatch.setattr("sys.argv", ["cut_sessions", *map(str, arms), "--out", str(out)])
    main()
    results = json.loads(out.read_text())
    trees = results["arms"][0]["trees"]
    assert trees["num_groups"] == 3 and trees["num_sessions"] == 7
    assert trees["num_cut_sessions"] == 4
    assert trees["cut_graded_reward_mean"] == 0.0
    assert trees["cut_tree_value_mean"] == (1 + 1 + 0 + 0) / 4
    assert trees["num_cut_valued_off_group_mean"] == 1      # g-mixed's s1: 1 against 0.5
    assert trees["rules"] == {
        "tree_value": {"num_sessions_entering": 7, "num_groups_with_variance": 1},
        "drop": {"num_sessions_entering": 3, "num_groups_with_variance": 1},
        "partial_credit": {"num_sessions_entering": 7, "num_groups_with_variance": 2}}
    tree_value = results["arms"][0]
    assert tree_value["cut_per_step"] == [3, 1] and tree_value["train_timeout_s"] == 140.0
    # Points from the held-out split only; gains and the arms' difference in rates.
    assert abs(tree_value["gain"]["difference"] - 30 / 150) < 1e-12
    assert tree_value["gain"]["excludes_zero"]
    [difference] = results["differences"]
    assert (difference["arm"], difference["against"]) == ("drop", "tree_value")
    assert abs(difference["difference"] - (45 - 60) / 150) < 1e-12
    low, high = difference["interval"]
    assert low < difference["difference"] < high
    assert out.with_suffix(".md").read_text() in capsys.readouterr().out
