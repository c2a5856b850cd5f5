"""The prefix cache's tree: matching, splitting, locking and LRU eviction under a byte bound."""

import torch

from undertow.gateway.builtin_engine.radix_cache import RadixCache


def kv_for(token_ids: list[int]) -> torch.Tensor:
    """Fake KV whose values encode (position, token), so a wrong slice is visible."""
    values = torch.tensor([[float(i * 1000 + t)] * 4 for i, t in enumerate(token_ids)])
    return values.view(1, 1, 1, len(token_ids), 4).expand(2, 2, 1, len(token_ids), 4).clone()


def insert(cache: RadixCache, token_ids: list[int]) -> list[tuple[int, int]]:
    reads = []
    full = kv_for(token_ids)

    def read(start, end):
        reads.append((start, end))
        return full[:, :, :, start:end]

    cache.insert(token_ids, read)
    return reads


def test_match_returns_the_longest_cached_prefix_and_its_kv():
    cache = RadixCache(max_bytes=1 << 20)
    insert(cache, [1, 2, 3, 4, 5])
    match = cache.match([1, 2, 3, 9, 9], max_length=5)
    assert match.length == 3
    assert torch.equal(cache.gather(match), kv_for([1, 2, 3, 4, 5])[:, :, :, :3])
    assert cache.match([7, 1, 2], max_length=3).length == 0
    assert cache.match([1, 2, 3, 4, 5], max_length=2).length == 2


def test_insert_reads_only_the_uncached_suffix_and_splits_nodes():
    cache = RadixCache(max_bytes=1 << 20)
    insert(cache, [1, 2, 3, 4, 5])
    reads = insert(cache, [1, 2, 3, 7, 8])
    assert reads == [(3, 5)]
    assert cache.num_tokens == 7
    for sequence in ([1, 2, 3, 4, 5], [1, 2, 3, 7, 8]):
        match = cache.match(sequence, max_length=5)
        assert match.length == 5
        assert torch.equal(cache.gather(match), kv_for(sequence))
    assert insert(cache, [1, 2, 3]) == []


def test_eviction_keeps_the_bound_and_drops_least_recently_used_first():
    one_sequence = kv_for([0] * 4).numel() * 4
    cache = RadixCache(max_bytes=2 * one_sequence)
    insert(cache, [1, 1, 1, 1])
    insert(cache, [2, 2, 2, 2])
    cache.match([1, 1, 1, 1], max_length=4)  # touch: now [2, ...] is the least recently used
    insert(cache, [3, 3, 3, 3])
    assert cache.num_bytes <= cache.max_bytes
    assert cache.match([1, 1, 1, 1], 4).length == 4
    assert cache.match([2, 2, 2, 2], 4).length == 0
    assert cache.match([3, 3, 3, 3], 4).length == 4


def test_locked_nodes_survive_eviction_until_unlocked():
    one_sequence = kv_for([0] * 4).numel() * 4
    cache = RadixCache(max_bytes=one_sequence)
    insert(cache, [1, 1, 1, 1])
    match = cache.match([1, 1, 1, 1, 5], max_length=4)
    cache.lock(match)
    insert(cache, [1, 1, 2, 2])  # splits the locked node, then must evict
    insert(cache, [3, 3, 3, 3])
    assert cache.match([1, 1, 1, 1], 4).length == 4
    cache.unlock(match)
    cache.evict()
    assert cache.num_bytes <= cache.max_bytes
    assert all(node.ref_count == 0 for node in cache.root.children.values())


def test_flush_empties_the_cache():
    cache = RadixCache(max_bytes=1 << 20)
    insert(cache, [1, 2, 3])
    cache.flush()
    assert cache.num_bytes == 0 and cache.num_tokens == 0
    assert cache.match([1, 2, 3], 3).length == 0
