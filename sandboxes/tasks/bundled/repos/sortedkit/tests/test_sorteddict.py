import pytest

from sortedkit import SortedDict


def test_iterates_in_key_order():
    mapping = SortedDict({"b": 2, "c": 3})
    mapping["a"] = 1
    assert list(mapping) == ["a", "b", "c"]
    assert mapping.items() == [("a", 1), ("b", 2), ("c", 3)]
    assert mapping.values() == [1, 2, 3]


def test_overwrite_keeps_one_key():
    mapping = SortedDict()
    mapping["x"] = 1
    mapping["x"] = 2
    assert mapping.keys() == ["x"]
    assert mapping["x"] == 2


def test_delete_and_pop():
    mapping = SortedDict({1: "a", 2: "b", 3: "c"})
    del mapping[2]
    assert mapping.pop(3) == "c"
    assert mapping.pop(9, None) is None
    with pytest.raises(KeyError):
        mapping.pop(9)
    assert mapping.items() == [(1, "a")]


def test_popitem_and_peekitem():
    mapping = SortedDict({1: "a", 2: "b", 3: "c"})
    assert mapping.peekitem(0) == (1, "a")
    assert mapping.popitem() == (3, "c")
    assert mapping.popitem(last=False) == (1, "a")
    assert len(mapping) == 1


def test_irange_over_keys():
    mapping = SortedDict({k: str(k) for k in range(10)})
    assert list(mapping.irange(2, 4)) == [2, 3, 4]


def test_copy_is_equal():
    mapping = SortedDict({2: "b", 1: "a"})
    assert mapping.copy() == mapping
