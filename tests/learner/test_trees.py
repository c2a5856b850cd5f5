"""The learner reads a gateway store with the gateway's own replay (`tree.replay_log`):
the tree it gets is the one the gateway rebuilds, and a damaged line is named alike."""

import json

import pytest

from tests.gateway.test_tree import logged_group
from undertow.gateway.front.store import StoreDamaged, TreeStore
from undertow.gateway.trees.group_log import LogLineError
from undertow.gateway.trees.tree import tree_to_json
from undertow.learner.trees import (
    StoreFileDamaged,
    group_staleness,
    load_store_tree,
    load_store_trees,
)


def test_the_learner_and_the_gateway_replay_a_store_to_one_tree(tmp_path, caplog):
    tree, lines = logged_group()   # lines written before checksums: accepted, and said so
    (tmp_path / "g.jsonl").write_bytes(b"\n".join(lines) + b"\n{\"kind\": \"ca")   # torn
    store = TreeStore(tmp_path, create=False)
    list(store.replay(repair=False))
    assert f"4 lines of {tmp_path} carry no checksum" in caplog.text
    expected = json.dumps(tree_to_json(tree), sort_keys=True)
    assert json.dumps(tree_to_json(store.tree("g")), sort_keys=True) == expected
    assert json.dumps(tree_to_json(load_store_tree(tmp_path / "g.jsonl")),
                      sort_keys=True) == expected
    [loaded] = load_store_trees(tmp_path)
    assert group_staleness(loaded, 3) == 3      # the oldest sampled token is version 0


def test_a_damaged_line_stops_both_readers_at_the_same_line(tmp_path):
    _, lines = logged_group()
    (tmp_path / "g.jsonl").write_bytes(b"\n".join([lines[0], b"{oops", *lines[1:]]) + b"\n")
    with pytest.raises(LogLineError) as learner:
        load_store_tree(tmp_path / "g.jsonl")
    store = TreeStore(tmp_path, create=False)
    list(store.replay(repair=False))     # the gateway sets the group aside, named
    assert isinstance(store.damaged["g"], StoreDamaged)
    assert learner.value.line == 2 and "line 2 is damaged (not JSON" in str(store.damaged["g"])


def test_a_damaged_group_is_left_out_by_name_and_the_others_are_read(tmp_path, caplog):
    """Export, SFT, the run viewer and the trackers read a store whose one group the
    gateway set aside: that group is named (file, line, count) and the others kept, each
    the tree the log was written from."""
    tree, lines = logged_group()
    good = b"\n".join(lines) + b"\n"
    (tmp_path / "a.jsonl").write_bytes(good)
    (tmp_path / "b.jsonl").write_bytes(b"\n".join([lines[0], b"{oops", *lines[1:]]) + b"\n")
    (tmp_path / "c.jsonl").write_bytes(good)
    trees = load_store_trees(tmp_path)
    assert [t.group_id for t in trees] == ["a", "c"]
    expected = json.dumps({**tree_to_json(tree), "group": None}, sort_keys=True)
    for loaded in trees:
        assert json.dumps({**tree_to_json(loaded), "group": None},
                          sort_keys=True) == expected
    assert "1 damaged group(s) left out, the other 2 read" in caplog.text
    assert f"{tmp_path / 'b.jsonl'} line 2 is damaged (not JSON" in caplog.text
    with pytest.raises(StoreFileDamaged, match=r"b\.jsonl line 2 is damaged") as raised:
        load_store_tree(tmp_path / "b.jsonl")
    assert raised.value.line == 2 and raised.value.path == tmp_path / "b.jsonl"
