import random

import pytest

from sortedkit import AVLTree


def test_map_operations():
    tree = AVLTree([(3, "c"), (1, "a"), (2, "b")])
    tree[2] = "B"
    assert list(tree.items()) == [(1, "a"), (2, "B"), (3, "c")]
    assert len(tree) == 3
    assert tree.get(9, "none") == "none"
    with pytest.raises(KeyError):
        tree[9]


def test_random_inserts_stay_sorted():
    keys = random.Random(7).sample(range(10_000), 500)
    tree = AVLTree((key, None) for key in keys)
    assert list(tree) == sorted(keys)
    assert tree.min() == min(keys)
    assert tree.max() == max(keys)


def test_descending_inserts_stay_balanced():
    tree = AVLTree((key, key) for key in range(1023, -1, -1))
    assert tree.height() <= 11


def test_delete_leaves_and_missing_keys():
    tree = AVLTree((key, key) for key in range(10))
    del tree[9]
    del tree[0]
    assert list(tree) == list(range(1, 9))
    with pytest.raises(KeyError):
        del tree[42]


def test_floor_and_ceiling():
    tree = AVLTree((key, None) for key in [10, 20, 30])
    assert tree.floor(25) == 20
    assert tree.ceiling(25) == 30
    assert tree.floor(20) == 20
    assert tree.floor(5, None) is None
    with pytest.raises(KeyError):
        tree.ceiling(31)
