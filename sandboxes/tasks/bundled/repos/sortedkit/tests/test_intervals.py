import pytest

from sortedkit import IntervalSet


def test_overlapping_intervals_merge():
    intervals = IntervalSet([(1, 4), (2, 6), (10, 12)])
    assert list(intervals) == [(1, 6), (10, 12)]
    assert intervals.total_length() == 7


def test_interval_covering_several_is_merged():
    intervals = IntervalSet([(1, 2), (4, 5), (7, 8)])
    intervals.add(0, 10)
    assert list(intervals) == [(0, 10)]


def test_membership_is_half_open():
    intervals = IntervalSet([(1, 3)])
    assert 1 in intervals
    assert 2.5 in intervals
    assert 3 not in intervals


def test_remove_splits():
    intervals = IntervalSet([(0, 10)])
    intervals.remove(3, 5)
    assert list(intervals) == [(0, 3), (5, 10)]


def test_overlaps_and_gaps():
    intervals = IntervalSet([(1, 3), (6, 8)])
    assert intervals.overlaps(2, 7)
    assert not intervals.overlaps(3, 6)
    assert intervals.gaps(0, 10) == [(0, 1), (3, 6), (8, 10)]


def test_reversed_interval_is_an_error():
    with pytest.raises(ValueError):
        IntervalSet().add(5, 1)
