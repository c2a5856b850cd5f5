"""Packed steps and weights as bytes without pickle (`wire.py`), and blobs through a store.

- A packed step of two branching groups decodes to the same step: every tensor equal
  in dtype and value, every list and unit the same, so the loss is the same.
- Weights written from one model load into another of the same shape and make it equal;
  a model with other parameters is refused.
- A blob of 9 MiB (over TCPStore's 8 MiB limit per value) goes through a real TCPStore
  in pieces and comes back whole, and is deleted.
- The bytes carry no pickle: decoding never reaches `pickle`.
"""

import dataclasses
import datetime
import pickle

import pytest
import torch
import torch.distributed as dist

from undertow.learner.advantages import group_advantages
from undertow.learner.config import AdvantageConfig
from undertow.learner.packing import pack_step
from undertow.learner.wire import (
    decode_step,
    delete_blob,
    encode_step,
    encode_weights,
    get_blob,
    load_weights,
    put_blob,
)


def _step(random_trees):
    advantages = {(tree.group_id, s): a for tree in random_trees
                  for s, a in group_advantages(tree, AdvantageConfig()).items()}
    return pack_step(random_trees, advantages, 30)


def _assert_same(left, right):
    for field in dataclasses.fields(left):
        a, b = getattr(left, field.name), getattr(right, field.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), field.name
        elif field.name != "micro_batches":
            assert a == b, field.name


def test_a_packed_step_decodes_to_the_same_step(random_trees, monkeypatch):
    step = _step(random_trees)
    assert len(step.micro_batches) > 1
    data = encode_step(step)

    def refuse(*args, **kwargs):
        raise AssertionError("decoding unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    decoded = decode_step(data)
    _assert_same(decoded, step)
    assert len(decoded.micro_batches) == len(step.micro_batches)
    for left, right in zip(decoded.micro_batches, step.micro_batches, strict=True):
        _assert_same(left, right)
    assert None in {u.parent for u in decoded.units}


def test_weights_load_into_a_model_of_the_same_shape_only():
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    target = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    load_weights(target, encode_weights(source))
    for a, b in zip(source.parameters(), target.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="one model"):
        load_weights(torch.nn.Linear(4, 3), encode_weights(source))


def test_a_blob_over_the_store_limit_travels_in_pieces():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                           timeout=datetime.timedelta(seconds=30))
    data = torch.randint(0, 256, (9 * 2**20,), dtype=torch.uint8).numpy().tobytes()
    put_blob(store, "w", data)
    assert get_blob(client, "w") == data
    delete_blob(store, "w")
    assert not any(client.check([key]) for key in ("w/num_pieces", "w/0", "w/2"))
    delete_blob(store, "never")
