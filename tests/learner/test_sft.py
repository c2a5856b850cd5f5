"""`undertow sft`: store files load into the trees the gateway built, and training on
them raises the logprob of the sessions' sampled tokens."""

import json

import pytest
import torch

from undertow.gateway.trees.tree import tree_from_json, tree_to_json
from undertow.learner.config import SFTConfig
from undertow.learner.model import PolicyModel
from undertow.learner.packing import pack_step
from undertow.learner.sft import chosen_sessions, run_sft
from undertow.learner.trees import load_store_trees

from .conftest import build_random_tree

pytestmark = pytest.mark.slow


def _write_store(store, trees):
    """Store files as the gateway writes them: call records, then session closes."""
    store.mkdir()
    for tree in trees:
        replayed = type(tree)(tree.group_id)
        lines = []
        for call in tree.calls:
            path = tree.path_token_ids(call.leaf)
            prompt = path[:len(path) - call.num_completion_tokens]
            record = replayed.add_call(call.call_id, call.session_id, prompt,
                                       path[len(prompt):], [-1.0] * call.num_completion_tokens,
                                       [0] * call.num_completion_tokens)
            lines.append(record.to_json())
        for session_id, paths in tree.sessions.items():
            lines.append({"kind": "session_close", "session_id": session_id,
                          "reward": paths.reward, "meta": {}})
        (store / f"{tree.group_id}.jsonl").write_text(
            "".join(json.dumps(line) + "\n" for line in lines) + '{"kind": "ca')


def test_store_files_and_tree_json_rebuild_the_same_tree(tmp_path):
    trees = [build_random_tree(5, "g5"), build_random_tree(6, "g6")]
    _write_store(tmp_path / "store", trees)
    loaded = load_store_trees(tmp_path / "store")
    assert [t.group_id for t in loaded] == ["g5", "g6"]
    for original, tree in zip(trees, loaded, strict=True):
        assert {n.node_id: n.token_ids for n in tree.nodes.values()} == {
            n.node_id: n.token_ids for n in original.nodes.values()}
        assert {s: p.reward for s, p in tree.sessions.items()} == {
            s: p.reward for s, p in original.sessions.items()}
        again = tree_from_json(json.loads(json.dumps(tree_to_json(tree))))
        assert tree_to_json(again) == tree_to_json(tree)


def _mean_logprob(model_dir, trees):
    policy = PolicyModel.load(model_dir)
    step = pack_step(trees, chosen_sessions(trees, None), 8192)
    with torch.no_grad():
        scores = [policy.score(mb).logprobs for mb in step.micro_batches]
    return float(torch.cat(scores).mean())


def test_sft_raises_the_logprob_of_the_imitated_tokens(tiny_model_dir, tmp_path):
    trees = [build_random_tree(5, "g5"), build_random_tree(6, "g6")]
    config = SFTConfig(num_epochs=3, groups_per_step=1, lr=1e-3)
    out = run_sft(trees, tiny_model_dir, tmp_path / "sft", config)
    assert _mean_logprob(out, trees) > _mean_logprob(tiny_model_dir, trees) + 0.1
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6


def test_min_reward_leaves_out_low_reward_sessions():
    tree = build_random_tree(5, "g5")
    rewards = {s: p.reward for s, p in tree.sessions.items()}
    chosen = chosen_sessions([tree], 1.0)
    assert chosen == {("g5", s): 1.0 for s, r in rewards.items() if r >= 1.0}


def test_sft_command_writes_a_model_directory(tiny_model_dir, tmp_path):
    from undertow.cli import main

    _write_store(tmp_path / "store", [build_random_tree(5, "g5")])
    out = tmp_path / "warm"
    assert main(["sft", "--store", str(tmp_path / "store"), "--model", str(tiny_model_dir),
                 "--out", str(out), "sft.num_epochs=1", "sft.lr=0.001"]) == 0
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert PolicyModel.load(out).model.config.vocab_size > 0
