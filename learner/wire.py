"""Packed steps and weights as bytes, for exchange between learner processes without pickle.

The learner's processes hand each other two things: the start weights of a step and the
packed micro-batches to train (`elastic/step.py` through its store, `sharding.py` by
broadcast within a cell). Unpickling bytes that another process wrote runs whatever
code they name, so neither travels as a pickle: tensors are a safetensors blob (a JSON
header with dtypes, shapes and offsets, then raw bytes), and the few non-tensor fields
(session keys, unit parents) ride in its string metadata as JSON. Decoding can only
ever build tensors, lists and numbers. Through a torch.distributed store a blob travels
in pieces (`put_blob`, `get_blob`).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from undertow.learner.packing import MicroBatch, PackedStep, Unit

_STEP_TENSORS = ("term_session", "term_path", "behaviour_logprobs", "advantages",
                 "term_version_gap")
_BATCH_TENSORS = ("token_ids", "position_ids", "unit_index", "unit_ancestors", "term_ids",
                  "term_token_index", "term_predictor_index")
_NO_PARENT = -1
PIECE_BYTES = 4 * 2**20
"""A blob is stored in pieces of at most this size: torch's TCPStore refuses a value
over 8 MiB."""


def encode_step(step: PackedStep) -> bytes:
    """The packed step as one safetensors blob."""
    tensors = {name: getattr(step, name).contiguous() for name in _STEP_TENSORS}
    tensors["term_origin"] = torch.tensor(step.term_origin, dtype=torch.long).reshape(-1, 3)
    tensors["units"] = torch.tensor(
        [[u.key, u.tree_index, u.node_id, u.start, u.end,
          _NO_PARENT if u.parent is None else u.parent, u.depth] for u in step.units],
        dtype=torch.long).reshape(-1, 7)
    batches = []
    for index, batch in enumerate(step.micro_batches):
        for name in _BATCH_TENSORS:
            tensors[f"mb{index}.{name}"] = getattr(batch, name).contiguous()
        batches.append({"unit_keys": batch.unit_keys, "unit_parents": batch.unit_parents,
                        "num_trained_tokens": batch.num_trained_tokens})
    header = {"session_keys": step.session_keys, "micro_batches": batches}
    return save_tensors(tensors, metadata={"undertow": json.dumps(header)})


def decode_step(data: bytes) -> PackedStep:
    """The packed step `encode_step` wrote."""
    tensors = load_tensors(data)
    header = json.loads(_metadata(data)["undertow"])
    batches = [MicroBatch(**{name: tensors[f"mb{index}.{name}"] for name in _BATCH_TENSORS},
                          unit_keys=fields["unit_keys"], unit_parents=fields["unit_parents"],
                          num_trained_tokens=fields["num_trained_tokens"])
               for index, fields in enumerate(header["micro_batches"])]
    units = [Unit(key, tree, node, start, end, None if parent == _NO_PARENT else parent, depth)
             for key, tree, node, start, end, parent, depth in tensors["units"].tolist()]
    return PackedStep(
        session_keys=[tuple(key) for key in header["session_keys"]], micro_batches=batches,
        **{name: tensors[name] for name in _STEP_TENSORS},
        term_origin=[tuple(origin) for origin in tensors["term_origin"].tolist()], units=units)


def encode_weights(model: torch.nn.Module) -> bytes:
    """The model's parameters (a tied parameter once, under its first name) as CPU bytes."""
    return save_tensors({name: parameter.detach().cpu().contiguous()
                         for name, parameter in model.named_parameters()})


def load_weights(model: torch.nn.Module, data: bytes) -> None:
    """Copies the parameters `encode_weights` wrote into `model`, which must have the
    same names and shapes."""
    tensors = load_tensors(data)
    names = [name for name, _ in model.named_parameters()]
    if sorted(names) != sorted(tensors):
        raise ValueError(f"the weights hold {len(tensors)} tensors and the model has "
                         f"{len(names)} parameters with other names; both must be one model")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(tensors[name])


def put_blob(store: Any, key: str, data: bytes) -> None:
    """Stores `data` under `key` in a torch.distributed store, in pieces; the count is
    written last, so a reader that sees it finds every piece."""
    num_pieces = max(1, -(-len(data) // PIECE_BYTES))
    for index in range(num_pieces):
        store.set(f"{key}/{index}", data[index * PIECE_BYTES:(index + 1) * PIECE_BYTES])
    store.set(f"{key}/num_pieces", str(num_pieces))


def get_blob(store: Any, key: str) -> bytes:
    """The bytes `put_blob` stored under `key` (waiting for them, as `store.get` does)."""
    num_pieces = int(store.get(f"{key}/num_pieces"))
    return b"".join(store.get(f"{key}/{index}") for index in range(num_pieces))


def delete_blob(store: Any, key: str) -> None:
    """Frees the pieces of `key` (a blob that was never stored is a no-op)."""
    if not store.check([f"{key}/num_pieces"]):
        return
    num_pieces = int(store.get(f"{key}/num_pieces"))
    store.delete_key(f"{key}/num_pieces")
    for index in range(num_pieces):
        store.delete_key(f"{key}/{index}")


def _metadata(data: bytes) -> dict[str, str]:
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]).get("__metadata__", {})
