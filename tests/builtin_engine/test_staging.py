"""The slot bookkeeping of staged KV imports (`builtin_engine/staging.py`): whatever joins,
leaves or is taken, each staging's KV stays in the slot right after the running requests
that its place in `entries` names, and a taken staging is in the slot its request gets."""

import pytest
import torch

from undertow.gateway.builtin_engine.model import SlotKV
from undertow.gateway.builtin_engine.model_config import ModelConfig, RopeConfig
from undertow.gateway.builtin_engine.staging import StagedSlots, StagingConflict
from undertow.gateway.kv_wire import PrefixDigest

CONFIG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=16, intermediate_size=32,
                     num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6,
                     rope=RopeConfig(1e4), max_position_embeddings=4096,
                     tie_word_embeddings=True, eos_token_ids=())


def kv_of(seed: int, num_tokens: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(CONFIG.num_layers, 2, CONFIG.num_kv_heads, num_tokens, CONFIG.head_dim,
                       generator=generator)


def assert_in_place(slots: StagedSlots, num_running: int, expected: dict[str, torch.Tensor]):
    for index, entry in enumerate(slots.entries):
        stored = slots.kv.read(num_running + index, 0, entry.num_tokens)
        assert torch.equal(stored, expected[entry.handle]), entry.handle


def test_stagings_follow_the_running_slots_through_joins_leaves_and_takes():
    kv = SlotKV(CONFIG)
    kv.reserve(2, 8)  # two running requests, slots 0 and 1
    slots = StagedSlots(kv)
    expected = {}
    for seed, length in enumerate((5, 9, 3)):
        full = kv_of(seed, length)
        entry = slots.stage(None, 0, list(range(length - 2)), full[:, :, :, :length - 2], 2)
        slots.stage(entry.handle, length - 2, [7, 7], full[:, :, :, length - 2:], 2)
        expected[entry.handle] = full
    assert_in_place(slots, 2, expected)
    slots.vacate(2)  # a third request joins, in slot 2
    assert_in_place(slots, 3, expected)
    slots.fill_hole(2)  # it leaves again
    assert_in_place(slots, 2, expected)
    second = slots.entries[1]
    taken = slots.take(second.handle, 2)  # not the first: swapped into slot 2
    assert taken is second
    assert torch.equal(kv.read(2, 0, taken.num_tokens), expected[taken.handle])
    assert_in_place(slots, 3, expected)
    slots.release(slots.entries[0].handle, 3)
    assert len(slots.entries) == 1
    assert_in_place(slots, 3, expected)


def test_claim_checks_the_prefix_and_keeps_a_refused_staging():
    slots = StagedSlots(SlotKV(CONFIG))
    entry = slots.stage(None, 0, [1, 2, 3], kv_of(0, 3), 0)
    digest = PrefixDigest()
    digest.update([1, 2])
    digest.update([3])  # cut differently: the same digest
    wrong = PrefixDigest()
    wrong.update([1, 2, 4])
    with pytest.raises(StagingConflict) as other:
        slots.claim(entry.handle, 3, wrong.hexdigest())
    with pytest.raises(StagingConflict) as unknown:
        slots.claim("no-such-handle", 3, digest.hexdigest())
    assert other.value.status == 409 and "another prefix" in str(other.value)
    assert unknown.value.status == 404
    assert slots.claim(entry.handle, 3, digest.hexdigest()) == [1, 2, 3]
    with pytest.raises(StagingConflict):  # claimed: neither grown nor released
        slots.stage(entry.handle, 3, [4], kv_of(1, 1), 0)
    slots.unclaim(entry.handle)
    assert slots.take(entry.handle, 0) is entry and not slots.entries


def test_a_span_that_does_not_continue_the_staging_is_refused():
    slots = StagedSlots(SlotKV(CONFIG))
    entry = slots.stage(None, 0, [1, 2, 3], kv_of(0, 3), 0)
    with pytest.raises(StagingConflict) as gap:
        slots.stage(entry.handle, 5, [4], kv_of(1, 1), 0)
    with pytest.raises(StagingConflict) as late_start:
        slots.stage(None, 2, [4], kv_of(1, 1), 0)
    assert "holds 3 tokens" in str(gap.value) and "position 0" in str(late_start.value)
    assert entry.num_tokens == 3 and len(slots.entries) == 1
