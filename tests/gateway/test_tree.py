"""The prefix tree's invariants, on hand-made and random call sequences."""

import json
import math
import random

import pytest

from undertow.gateway.trees.group_log import LogLineError, ReplayReport, encode_event, replay_log
from undertow.gateway.trees.tree import (
    ROOT,
    CallRecord,
    Tree,
    TreeError,
    tree_to_json,
)

SYSTEM = [1, 2, 3, 4, 5]


def _call(tree, call_id, session, prompt, completion, version=0):
    logprobs = [-0.1 * (i + 1) for i in range(len(completion))]
    return tree.add_call(call_id, session, prompt, completion, logprobs,
                         [version] * len(completion))


def test_extension_shares_history_and_stores_only_new_tokens():
    tree = Tree("g")
    _call(tree, "c1", "A", SYSTEM + [10], [20, 21])
    record = _call(tree, "c2", "A", SYSTEM + [10, 20, 21, 11], [22])
    assert record.token_ids == [11, 22] and record.num_prompt == 1
    (leaf,) = tree.sessions["A"].leaves
    assert tree.path_token_ids(leaf) == SYSTEM + [10, 20, 21, 11, 22]
    assert tree.num_unique_tokens == 10
    assert tree.num_flat_tokens == 8 + 10


def test_sampled_tokens_are_never_shared_between_sessions():
    tree = Tree("g")
    _call(tree, "c1", "A", SYSTEM, [20, 21])
    _call(tree, "c2", "B", SYSTEM, [20, 21])
    owners = sorted(n.sampled_by for n in tree.nodes.values() if n.trainable)
    assert owners == ["A", "B"]
    prompt_nodes = [n for n in tree.nodes.values() if n.token_ids and not n.trainable]
    assert [n.token_ids for n in prompt_nodes] == [SYSTEM]


def test_other_sessions_sampled_tokens_in_a_prompt_are_prompt_tokens():
    tree = Tree("g")
    _call(tree, "c1", "A", SYSTEM, [20, 21])
    _call(tree, "c2", "B", SYSTEM + [20, 21, 7], [8])
    (leaf,) = tree.sessions["B"].leaves
    path = [tree.nodes[n] for n in tree.path(leaf)]
    assert [n.sampled_by for n in path] == [None, None, "B"]
    assert tree.path_token_ids(leaf) == SYSTEM + [20, 21, 7, 8]


def test_rewritten_history_keeps_both_paths_and_splits_without_renumbering_leaves():
    tree = Tree("g")
    _call(tree, "c1", "A", SYSTEM + [10], [20, 21, 22])
    (old_leaf,) = tree.sessions["A"].leaves
    tree.add_call("c2", "A", SYSTEM + [10, 20, 99], [23], [-0.5], [1], branch="rewrite")
    leaves = tree.sessions["A"].leaves
    assert leaves[0] == old_leaf and len(leaves) == 2
    assert tree.path_token_ids(old_leaf) == SYSTEM + [10, 20, 21, 22]
    assert tree.path_token_ids(leaves[1]) == SYSTEM + [10, 20, 99, 23]
    assert tree.calls[-1].branch == "rewrite"
    split_head = tree.nodes[tree.nodes[old_leaf].parent]
    assert split_head.token_ids == [20] and split_head.sampled_by == "A"
    assert tree.nodes[leaves[1]].weight_versions == [1]


def test_prompt_tokens_carry_no_logprob_and_sampled_ones_keep_theirs():
    tree = Tree("g")
    tree.add_call("c1", "A", SYSTEM, [20, 21], [-0.25, -1.5], [3, 4])
    prompt, sampled = (tree.nodes[n] for n in tree.path(tree.sessions["A"].leaves[0]))
    assert all(math.isnan(x) for x in prompt.logprobs) and prompt.weight_versions == [-1] * 5
    assert sampled.logprobs == [-0.25, -1.5] and sampled.weight_versions == [3, 4]


def test_mismatched_lengths_and_unknown_anchor_are_errors():
    tree = Tree("g")
    with pytest.raises(TreeError, match="2 completion tokens but 1 logprobs"):
        tree.add_call("c1", "A", SYSTEM, [20, 21], [-0.1], [0, 0])
    bad = CallRecord("c2", "A", (42, 0), [1], 1, [], [])
    with pytest.raises(TreeError, match="anchor node 42"):
        tree.apply(bad)


@pytest.mark.parametrize("logprob", [math.nan, -math.inf])
def test_a_logprob_json_cannot_hold_is_refused_before_the_tree_changes(logprob):
    tree = Tree("g")
    with pytest.raises(TreeError, match="not a finite number"):
        tree.add_call("c1", "A", SYSTEM, [20, 21], [-0.5, logprob], [0, 0])
    assert tree.calls == [] and len(tree.nodes) == 1


def test_close_session_keeps_reward():
    tree = Tree("g")
    _call(tree, "c1", "A", SYSTEM, [20])
    tree.close_session("A", 0.5, {"timed_out": True})
    assert tree.sessions["A"].reward == 0.5 and tree.sessions["A"].closed


def _random_calls(rng, num_sessions=4, num_calls=30):
    """Sessions that mostly extend their history, sometimes rewrite it."""
    history = {f"s{i}": SYSTEM + [rng.randrange(6, 9)] for i in range(num_sessions)}
    calls = []
    for index in range(num_calls):
        session = rng.choice(sorted(history))
        prompt = list(history[session])
        if rng.random() < 0.25 and len(prompt) > 6:
            prompt = prompt[: rng.randrange(5, len(prompt))] + [rng.randrange(6, 12)]
        completion = [rng.randrange(6, 12) for _ in range(rng.randrange(0, 4))]
        calls.append((f"c{index}", session, prompt, completion))
        history[session] = prompt + completion + [rng.randrange(6, 12)]
    return calls


@pytest.mark.parametrize("seed", range(20))
def test_random_calls_replay_to_the_same_tree_and_paths(seed):
    rng = random.Random(seed)
    tree, records, num_completion = Tree("g"), [], 0
    for call_id, session, prompt, completion in _random_calls(rng):
        num_completion += len(completion)
        records.append(_call(tree, call_id, session, prompt, completion))
        leaf = tree.calls[-1].leaf
        assert tree.path_token_ids(leaf) == prompt + completion
        sampled = [t for n in tree.path(leaf) for t in tree.nodes[n].token_ids
                   if tree.nodes[n].sampled_by == session]
        assert sampled[-len(completion):] == completion or not completion
    replayed = Tree("g")
    for record in records:
        replayed.apply(CallRecord.from_json(json.loads(json.dumps(record.to_json()))))
    shape = lambda t: {k: (n.parent, n.token_ids, n.sampled_by) for k, n in t.nodes.items()}  # noqa: E731
    assert shape(replayed) == shape(tree)
    assert {s: p.leaves for s, p in replayed.sessions.items()} == \
        {s: p.leaves for s, p in tree.sessions.items()}
    # the log holds each unique token once, plus completions that repeated a known span
    assert sum(len(r.token_ids) for r in records) <= tree.num_unique_tokens + num_completion
    for node in tree.nodes.values():
        if node.node_id != ROOT:
            assert node.token_ids, "only the root is empty"
            assert tree.nodes[node.parent].children[(node.token_ids[0], node.sampled_by)] \
                == node.node_id


def test_a_transaction_that_raises_leaves_the_tree_exactly_as_it_was():
    rng = random.Random(5)

    def random_call(tree, call_id):
        prompt = rng.choice([SYSTEM, SYSTEM[:3], [7, 8]]) + [rng.randint(1, 6)
                                                            for _ in range(rng.randint(0, 6))]
        completion = [rng.randint(1, 6) for _ in range(rng.randint(1, 5))]
        _call(tree, call_id, rng.choice("ABC"), prompt, completion)

    num_splits_undone = 0
    for trial in range(200):
        tree = Tree("g")
        for index in range(rng.randint(0, 8)):
            random_call(tree, f"c{index}")
        before = json.dumps(tree_to_json(tree), sort_keys=True)
        num_nodes = len(tree.nodes)
        with pytest.raises(OSError), tree.transaction():
            for index in range(rng.randint(1, 4)):
                random_call(tree, f"new{index}")
            num_splits_undone += any(len(node.children) > 1 for node in tree.nodes.values())
            raise OSError("the write failed")
        assert json.dumps(tree_to_json(tree), sort_keys=True) == before, trial
        assert len(tree.nodes) == num_nodes
        random_call(tree, "after")  # IDs are handed out again from where they were
        assert max(tree.nodes) == len(tree.nodes) - 1
    assert num_splits_undone > 50


def logged_group() -> tuple[Tree, list[bytes]]:
    """A group of two sessions (a shared prefix, a history rewrite, one close) and the
    lines of its log, as the gateway's store writes them."""
    tree, records = Tree("g"), []
    records.append(tree.add_call("c0", "s0", [1, 2, 3], [4, 5], [-0.1, -0.2], [0, 0]))
    records.append(tree.add_call("c1", "s0", [1, 2, 3, 4, 5, 6], [7], [-0.3], [1]))
    records.append(tree.add_call("c2", "s1", [1, 2, 9], [8], [-0.4], [1], branch="rewrite"))
    tree.close_session("s0", 1.0, {"cause": "done"})
    lines = [json.dumps(r.to_json()).encode() for r in records]
    lines.append(json.dumps({"kind": "session_close", "session_id": "s0", "reward": 1.0,
                             "meta": {"cause": "done"}}).encode())
    return tree, lines


def test_replay_log_rebuilds_the_same_tree_and_leaves_a_torn_last_line_out():
    tree, lines = logged_group()
    data = b"\n".join(lines) + b'\n\n{"kind": "call", "call_id": "c3", "ses'
    replayed = Tree("g")
    events = list(replay_log(replayed, data))
    assert [number for number, _ in events] == [1, 2, 3, 4]    # the blank line 5 skipped
    assert json.dumps(tree_to_json(replayed), sort_keys=True) == json.dumps(
        tree_to_json(tree), sort_keys=True)


@pytest.mark.parametrize("damage, reason", [
    (b"{not json", "not JSON"),
    (b'{"kind": "call", "call_id": "c9"}', "a call event without session_id"),
    (b'{"kind": "call", "call_id": "c9", "session_id": "s9", "anchor": [99, 0], '
     b'"token_ids": [1], "num_prompt": 1, "logprobs": [], "weight_versions": []}',
     "anchor node 99 is unknown"),
])
def test_a_damaged_line_is_named_with_its_offset_and_the_events_kept(damage, reason):
    _, lines = logged_group()
    data = b"\n".join([*lines[:2], damage, *lines[2:]]) + b"\n"
    with pytest.raises(LogLineError) as damaged:
        list(replay_log(Tree("g"), data))
    error = damaged.value
    assert (error.line, error.num_kept, error.offset) == (3, 2, len(lines[0]) + len(lines[1]) + 2)
    assert reason in error.reason and isinstance(error, TreeError)
    assert data[error.offset:].startswith(damage)


def split_group() -> tuple[list[CallRecord], list[bytes]]:
    """Three sessions: b's call splits the shared prompt node, c's first call then splits
    its tail (anchored inside it) and c's second extends c's leaf. Returns the records and
    their log lines (`encode_event`, with checksums, as the store writes them)."""
    tree = Tree("g")
    records = [_call(tree, "c0", "A", [1, 2, 3, 4, 5, 6], [10]),
               _call(tree, "c1", "B", [1, 2, 3, 9], [11]),
               _call(tree, "c2", "C", [1, 2, 3, 4, 5, 7], [12]),
               _call(tree, "c3", "C", [1, 2, 3, 4, 5, 7, 12, 8], [13])]
    assert records[2].anchor[1] == 2     # inside the tail that c1's split left
    return records, [encode_event(record.to_json()) for record in records]


def paths_of(tree: Tree) -> dict[str, tuple]:
    """Each call's path of IDs, split into prompt and sampled, with its logprobs."""
    out = {}
    for call in tree.calls:
        nodes = [tree.nodes[n] for n in tree.path(call.leaf)]
        out[call.call_id] = (
            [t for node in nodes if not node.trainable for t in node.token_ids],
            [t for node in nodes if node.trainable for t in node.token_ids],
            [p for node in nodes if node.trainable for p in node.logprobs])
    return out


@pytest.mark.parametrize("damage", ["garbage", "truncated", "token changed"])
def test_skipping_a_lost_record_keeps_the_later_ones_on_their_own_paths(damage):
    _, lines = split_group()
    lost = {"garbage": b"\0\0\0\n", "truncated": lines[1][:60] + b"\n",
            "token changed": lines[1].replace(b'"token_ids":[9,', b'"token_ids":[8,')}[damage]
    data = b"".join([lines[0], lost, lines[2], lines[3]])
    report, replayed = ReplayReport(), Tree("g")
    kept = [event["call_id"] for _, event in replay_log(replayed, data, report,
                                                        skip_damaged=True)]
    assert kept == ["c0", "c2", "c3"] and [e.line for e in report.skipped] == [2]
    reference = Tree("g")    # the calls kept, recorded afresh from their full IDs
    _call(reference, "c0", "A", [1, 2, 3, 4, 5, 6], [10])
    _call(reference, "c2", "C", [1, 2, 3, 4, 5, 7], [12])
    _call(reference, "c3", "C", [1, 2, 3, 4, 5, 7, 12, 8], [13])
    assert paths_of(replayed) == paths_of(reference)
    assert replayed.num_unique_tokens == reference.num_unique_tokens
    with pytest.raises(LogLineError):   # without skipping, the damage still stops replay
        list(replay_log(Tree("g"), data))


def test_a_record_that_would_land_elsewhere_is_refused():
    records, lines = split_group()
    moved = records[3].to_json()
    moved["anchor_path"] = [moved["anchor_path"][0], moved["anchor_path"][1] ^ 1]
    data = b"".join([*lines[:3], encode_event(moved)])
    with pytest.raises(LogLineError) as refused:
        list(replay_log(Tree("g"), data))
    assert refused.value.line == 4 and "does not hold the path" in refused.value.reason


def test_a_changed_token_fails_its_checksum_and_old_lines_are_accepted_unchecked():
    _, lines = split_group()
    changed = lines[1].replace(b'"token_ids":[9,', b'"token_ids":[8,')
    assert changed != lines[1] and json.loads(changed)["token_ids"][0] == 8   # valid JSON
    with pytest.raises(LogLineError) as refused:
        list(replay_log(Tree("g"), b"".join([lines[0], changed, *lines[2:]])))
    assert refused.value.line == 2 and "checksum does not match" in refused.value.reason
    tree, old_lines = logged_group()        # lines written before checksums
    report, replayed = ReplayReport(), Tree("g")
    assert len(list(replay_log(replayed, b"\n".join(old_lines) + b"\n", report))) == 4
    assert report.num_unchecked == 4 and paths_of(replayed) == paths_of(tree)
    report = ReplayReport()
    assert len(list(replay_log(Tree("g"), b"".join(lines), report))) == 4
    assert report.num_unchecked == 0
