"""`python -m benchmarks.tree_worth` on a store written by the gateway's own `TreeStore`
from multi-call group trees (a shared prefix, token truth, a history rewrite): its counts
against a count of the calls' own tokens, and the tiny model's tree and per-session steps
on the stored trees, whose losses agree."""

import asyncio
import json
import random
from pathlib import Path

import pytest

from benchmarks.tree_worth import (
    bucket_of,
    grad_errors,
    group_counts,
    main,
    spread,
    stand_in_rewards,
)
from undertow.gateway.front.store import TreeStore
from undertow.gateway.trees.tree import Tree

PREFIX_LEN = 12


class Group:
    """A group tree built through `Tree.add_call`, with what the counts must be, counted
    from the calls' own token lists. Every token past the shared prefix is drawn fresh
    (no ID twice in a store), so a token is new to the tree exactly when its sequence up
    to it is new: unique tokens are distinct sequence prefixes."""

    def __init__(self, group_id: str, calls_per_session: list[int], rewards: list[float],
                 fresh, rng: random.Random, rewrite_session: int | None = None):
        self.tree, self.records = Tree(group_id), []
        self.sequences: dict[str, list[list[int]]] = {}
        self.rewards = {f"s{i}": reward for i, reward in enumerate(rewards)}
        prefix = [next(fresh) for _ in range(PREFIX_LEN)]
        for index, num_calls in enumerate(calls_per_session):
            self._add_session(f"s{index}", num_calls, prefix, fresh, rng,
                              rewrite=index == rewrite_session)

    def _add_session(self, session_id, num_calls, prefix, fresh, rng, rewrite):
        history = prefix + [next(fresh) for _ in range(rng.randrange(1, 4))]
        for turn in range(num_calls):
            if rewrite and turn == num_calls - 1:
                cut = rng.randrange(PREFIX_LEN + 1, len(history) - 4)
                history = history[:cut] + [next(fresh) for _ in range(2)]
            completion = [next(fresh) for _ in range(rng.randrange(1, 6))]
            self.records.append(self.tree.add_call(
                f"{session_id}-{turn}", session_id, history, completion,
                [rng.uniform(-9.6, -8.2) for _ in completion], [0] * len(completion)))
            self.sequences.setdefault(session_id, []).append(history + completion)
            history = history + completion + [next(fresh) for _ in range(rng.randrange(1, 5))]

    def expected(self) -> dict:
        every = [seq for seqs in self.sequences.values() for seq in seqs]
        paths = [seq for seqs in self.sequences.values() for seq in seqs
                 if not any(len(other) > len(seq) and other[:len(seq)] == seq
                            for other in seqs)]
        counts = [len(seqs) for seqs in self.sequences.values()]
        return {"group": self.tree.group_id, "num_sessions": len(counts),
                "num_distinct_sessions": len(counts),      # fresh tokens: all differ
                "num_calls": sum(counts),
                "calls_per_session": {"mean": sum(counts) / len(counts), "min": min(counts),
                                      "max": max(counts)},
                "num_unique_tokens": len({tuple(seq[:n]) for seq in every
                                          for n in range(1, len(seq) + 1)}),
                "num_flat_tokens": sum(len(seq) for seq in every),
                "num_session_paths": len(paths),
                "num_session_tokens": sum(len(seq) for seq in paths)}


async def write_store(store_dir: Path, groups: list[Group]) -> None:
    store = TreeStore(store_dir)
    await store.start()
    for group in groups:
        for record in group.records:
            await store.append(group.tree.group_id, record.to_json())
        for session_id, reward in group.rewards.items():
            await store.append(group.tree.group_id, {
                "kind": "session_close", "session_id": session_id, "reward": reward,
                "meta": {"cause": "exited"}})
    await store.close()


def make_groups() -> list[Group]:
    rng = random.Random(0)
    fresh = iter(rng.sample(range(1, 6000), 3000))
    return [Group("g-long", [7, 8], [1.0, 1.0], fresh, rng),     # uniform: stand-ins
            Group("g-short", [1, 2, 2], [1.0, 0.0, 0.5], fresh, rng),
            Group("g-mid", [3, 5, 8, 4], [0.0, 1.0, 0.0, 0.0], fresh, rng, rewrite_session=2)]


@pytest.mark.slow
def test_counts_match_the_calls_and_both_steps_reach_one_loss(tmp_path, tiny_model_dir,
                                                              capsys):
    groups = make_groups()
    asyncio.run(write_store(tmp_path / "store", groups))
    out = tmp_path / "results" / "tree_worth.json"
    main([str(tmp_path / "store"), "--model", str(tiny_model_dir), "--max-groups", "2",
          "--compare-grads", "--out", str(out)])
    results = json.loads(out.read_text())
    rows = {row["group"]: row for row in results["groups"]}
    # Listed by mean calls per session: 1.67, 5, 7.5.
    assert [row["group"] for row in results["groups"]] == ["g-short", "g-mid", "g-long"]
    for group in groups:
        expected = group.expected()
        assert {key: rows[group.tree.group_id][key] for key in expected} == expected
    assert rows["g-mid"]["num_session_paths"] == 5     # the rewrite left a second path
    assert [b["calls_per_session"] for b in results["buckets"]] == ["1-2", "5-6", "7-8"]
    # Two groups timed, the fewest and the most calls per session: each method's step ran
    # the tokens its counts say, and the losses and gradients agree.
    assert "timing" not in rows["g-mid"]
    assert (rows["g-short"]["rewards"], rows["g-long"]["rewards"]) == ("stored", "stand-in")
    for name in ("g-short", "g-long"):
        row = rows[name]
        timing = row["timing"]
        assert set(timing) == {"tree", "per_session"}
        assert timing["tree"]["num_tokens"] == row["num_unique_tokens"]
        assert timing["per_session"]["num_tokens"] == row["num_session_tokens"]
        assert timing["tree"]["loss"] != 0.0
        assert timing["per_session"]["loss"] == pytest.approx(timing["tree"]["loss"],
                                                              rel=1e-5)
        ratios = row["per_session_over_tree"]
        assert ratios["step_cpu_s"] == pytest.approx(
            timing["per_session"]["step_cpu_s"] / timing["tree"]["step_cpu_s"])
        assert ratios["grad_rel_error"] < 1e-4 and ratios["grad_rel_norm_error"] < 1e-4
    assert results["command"].startswith("python -m benchmarks.tree_worth ")
    table = out.with_suffix(".md").read_text()
    assert table.strip() in capsys.readouterr().out
    assert "| g-long | 2 (2) | 7.5 (7-8) | 102 | 549 | 5.38x | 114 | 1.12x |" in table
    assert "| g-long | 7.5 | stand-in | per_session | 114 |" in table
    assert "| 7-8 | 1 | 2 | 15 | 102 | 549 | 5.38x | 1.12x | 1 |" in table


def fake_model(tmp_path: Path, vocab_size: int) -> Path:
    """A model directory as far as the benchmark checks before any worker runs."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    return tmp_path / "model"


def test_a_store_without_trees_a_missing_model_and_another_vocabulary_are_named(tmp_path):
    model = fake_model(tmp_path, vocab_size=100)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="holds no group tree"):
        main([str(tmp_path / "empty"), "--model", str(model)])
    with pytest.raises(SystemExit, match="no tree store at"):
        main([str(tmp_path / "absent"), "--model", str(model)])
    with pytest.raises(SystemExit, match="no model at"):
        main([str(tmp_path / "empty"), "--model", str(tmp_path / "absent-model")])
    asyncio.run(write_store(tmp_path / "store", make_groups()[:1]))
    with pytest.raises(SystemExit, match="past model's vocabulary of 100"):
        main([str(tmp_path / "store"), "--model", str(model)])


def test_timed_groups_spread_over_calls_per_session_and_buckets_are_pairs():
    assert spread(6, 2) == [0, 5] and spread(6, 3) == [0, 2, 5] and spread(6, 1) == [5]
    assert spread(3, 10) == [0, 1, 2] and spread(3, 0) == []
    # by the mean rounded: 2.4 is 2, 2.5 is 3, 6.125 is 6
    assert [bucket_of(m) for m in (0.4, 1.0, 2.4, 2.5, 4.0, 6.125, 6.5, 31.0)] == [
        "1-2", "1-2", "1-2", "3-4", "3-4", "5-6", "7-8", "31-32"]


def test_the_gradient_errors_are_the_worst_parameter_and_the_whole_vector(tmp_path):
    import torch
    from safetensors.torch import save_file

    expected = {"a": torch.tensor([2.0, -4.0]), "b": torch.tensor([0.5, 0.25])}
    got = {"a": torch.tensor([2.0, -3.0]), "b": torch.tensor([0.5, 0.5])}
    save_file(expected, str(tmp_path / "expected.safetensors"))
    save_file(got, str(tmp_path / "got.safetensors"))
    errors = grad_errors(tmp_path / "expected.safetensors", tmp_path / "got.safetensors")
    assert errors["grad_rel_error"] == pytest.approx(0.5)     # b: 0.25 / 0.5 (a: 1 / 4)
    assert errors["grad_rel_norm_error"] == pytest.approx(
        ((1 + 0.25 ** 2) / (4 + 16 + 0.25 + 0.0625)) ** 0.5)


def test_sessions_of_the_same_tokens_count_once_and_share_a_stand_in_reward():
    """A uniform group where s0 and s2 sampled the same tokens: they get one stand-in
    reward, s1 the other; a group of stored rewards keeps them."""
    tree = Tree("g")
    for session_id, completion in (("s0", [7, 8]), ("s1", [9]), ("s2", [7, 8])):
        tree.add_call(f"{session_id}-0", session_id, [1, 2, 3], completion,
                      [-1.0] * len(completion), [0] * len(completion))
        tree.close_session(session_id, 1.0, {"cause": "exited"})
    assert group_counts(tree)["num_distinct_sessions"] == 2
    assert stand_in_rewards(tree)
    rewards = {s: p.reward for s, p in tree.sessions.items()}
    assert rewards == {"s0": 0.0, "s1": 1.0, "s2": 0.0}
    assert tree.sessions["s1"].meta == {"cause": "exited"}
    assert not stand_in_rewards(tree)       # no longer uniform: kept
