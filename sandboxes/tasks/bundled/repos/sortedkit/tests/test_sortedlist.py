import pytest

from sortedkit import SortedList


def test_items_are_kept_sorted():
    items = SortedList([5, 1, 4])
    items.add(3)
    items.update([2, 0])
    assert list(items) == [0, 1, 2, 3, 4, 5]
    assert items[0] == 0
    assert items[-1] == 5
    assert items[1:3] == [1, 2]


def test_duplicates_count_and_index():
    items = SortedList([2, 1, 2, 3, 2])
    assert items.count(2) == 3
    assert items.index(2) == 1
    assert 4 not in items


def test_remove_and_discard():
    items = SortedList([1, 2, 3])
    items.remove(2)
    items.discard(7)
    assert list(items) == [1, 3]
    with pytest.raises(ValueError):
        items.remove(7)


def test_pop_defaults_to_largest():
    items = SortedList([3, 1, 2])
    assert items.pop() == 3
    assert items.pop(0) == 1
    assert list(items) == [2]


def test_bisect():
    items = SortedList([1, 2, 2, 3])
    assert items.bisect_left(2) == 1
    assert items.bisect_right(2) == 3


def test_irange_inclusive_and_open_ended():
    items = SortedList(range(10))
    assert list(items.irange(3, 6)) == [3, 4, 5, 6]
    assert list(items.irange(3, 6, inclusive=(True, False))) == [3, 4, 5]
    assert list(items.irange(maximum=2)) == [0, 1, 2]
    assert list(items.irange(minimum=8)) == [8, 9]


def test_key_function_orders_added_items():
    words = SortedList(key=len)
    for word in ["ccc", "a", "bb", "dd"]:
        words.add(word)
    assert list(words) == ["a", "bb", "dd", "ccc"]
    assert words.bisect_right("xx") == 3


def test_copy_has_the_same_items():
    items = SortedList([3, 1, 2])
    assert items.copy() == items
    assert items.copy() is not items
