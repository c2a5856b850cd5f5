import pytest

from sortedkit import IndexedHeap


def test_pops_in_priority_order():
    heap = IndexedHeap()
    for item, priority in [("c", 3), ("a", 1), ("d", 4), ("b", 2)]:
        heap.push(item, priority)
    assert [heap.pop() for _ in range(4)] == [("a", 1), ("b", 2), ("c", 3), ("d", 4)]
    assert len(heap) == 0


def test_equal_priorities_are_first_in_first_out():
    heap = IndexedHeap()
    for item in "xyz":
        heap.push(item, 5)
    assert [heap.pop()[0] for _ in range(3)] == ["x", "y", "z"]


def test_update_moves_items_both_ways():
    heap = IndexedHeap()
    for item, priority in [("a", 1), ("b", 2), ("c", 3)]:
        heap.push(item, priority)
    heap.update("c", 0)
    heap.update("a", 10)
    assert heap.peek() == ("c", 0)
    assert heap.priority("a") == 10
    assert [heap.pop()[0] for _ in range(3)] == ["c", "b", "a"]


def test_remove_the_smallest_and_the_last():
    heap = IndexedHeap()
    for item, priority in [("a", 1), ("b", 2), ("c", 3)]:
        heap.push(item, priority)
    heap.remove("a")
    heap.remove("c")
    assert "a" not in heap
    assert heap.pop() == ("b", 2)


def test_push_twice_and_empty_pop_are_errors():
    heap = IndexedHeap()
    heap.push("a", 1)
    with pytest.raises(ValueError):
        heap.push("a", 2)
    heap.pop()
    with pytest.raises(IndexError):
        heap.pop()
