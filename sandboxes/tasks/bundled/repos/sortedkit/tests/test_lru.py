import pytest

from sortedkit import LRUCache


def test_evicts_least_recently_used():
    evicted = []
    cache = LRUCache(2, on_evict=lambda key, value: evicted.append((key, value)))
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1
    cache.put("c", 3)
    assert evicted == [("b", 2)]
    assert cache.keys() == ["a", "c"]


def test_stats_and_hit_rate():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.get("a")
    cache.get("zzz")
    assert (cache.stats.num_hits, cache.stats.num_misses) == (1, 1)
    assert cache.stats.hit_rate == 0.5


def test_get_or_compute_calls_once():
    calls = []
    cache = LRUCache(4)

    def compute(key):
        calls.append(key)
        return key * 2

    assert cache.get_or_compute(3, compute) == 6
    assert cache.get_or_compute(3, compute) == 6
    assert calls == [3]


def test_resize_shrinks():
    cache = LRUCache(3)
    for key in "abc":
        cache.put(key, key)
    cache.resize(1)
    assert cache.keys() == ["c"]
    assert cache.stats.num_evictions == 2


def test_invalid_capacity():
    with pytest.raises(ValueError):
        LRUCache(0)
