"""A streaming training step whose data-parallel membership grows while it runs: the
`Coordinator` (the learner's process) and a `Member` per training cell, over one TCP
store; the gradient is exact whoever joins, and when (docs/cluster.md, "The elastic step").
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # pyright: ignore[reportPrivateImportUsage]  # public in torch's docs; re-exported without __all__

from undertow.cells.errors import CellPoolError
from undertow.learner.config import LossConfig, TrainConfig, torch_dtype
from undertow.learner.errors import EmptyStepError
from undertow.learner.losses import chunk_weights, step_count
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_micro_batch, merge_stats
from undertow.learner.packing import PackedStep
from undertow.learner.sharding import Placement, place
from undertow.learner.wire import (
    decode_step,
    delete_blob,
    encode_step,
    encode_weights,
    get_blob,
    load_weights,
    put_blob,
)

HOST = "127.0.0.1"
POLL_S = 0.02
OPEN, CLOSED = "open:", "closed:"
END = "end"
CPU_LEARNER = TrainConfig(device="cpu")
"""What a member trains with when it is given no `learner` section: float32 on the CPU."""


class MembershipError(CellPoolError):
    """A member failed, or the step did not finish within its timeout."""


@dataclass
class ElasticStepResult:
    """What one elastic step did. `claims[name]` are the micro-batch indices member
    `name` trained (together a partition of range(num_micro_batches), in the order the
    coordinator appended them); `weights_digests[name]` is the digest of the weights it
    trained with; `ranks` lists the members in rank order (rank 0 is the coordinator);
    `stats` are summed over members as `backward_step` sums them over micro-batches
    ("loss" and "loss_abs_sum" with the whole step's normaliser applied);
    `num_chunks` counts the appends; `drain_s` is how long `finish_step` waited for
    the queue's end to be drawn, `reduce_s` how long the final sum took (the members
    still training their last micro-batches included)."""

    step: int
    ranks: list[str]
    claims: dict[str, list[int]]
    weights_digests: dict[str, str]
    num_micro_batches: int = 0
    num_chunks: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    drain_s: float = 0.0
    reduce_s: float = 0.0


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over the parameters' names and bytes, in `named_parameters` order."""
    return tensors_digest(model.named_parameters())


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over (name, tensor) pairs' names and bytes, in order."""
    digest = hashlib.sha256()
    for name, parameter in named:
        digest.update(name.encode())
        digest.update(parameter.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def scoring_options(policy: PolicyModel) -> dict[str, int]:
    """How the coordinator's policy scores a micro-batch (the learner config's LM-head
    chunk and segment size), which every member of its steps scores with too."""
    return {"head_chunk_tokens": policy.head_chunk_tokens,
            "max_segment_tokens": policy.max_segment_tokens}


def use_scoring_options(options: dict[str, int], *policies: PolicyModel | None) -> None:
    """Makes a member's policies score as `scoring_options` of the coordinator's."""
    for policy in policies:
        if policy is not None:
            policy.head_chunk_tokens = options["head_chunk_tokens"]
            policy.max_segment_tokens = options["max_segment_tokens"]


def step_store(store: Store, step: int) -> PrefixStore:
    return PrefixStore(f"step/{step}/", store)


def _process_group(backend: str, store: Store, rank: int, size: int,
                   timeout_s: float) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl" and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise MembershipError(f"backend {backend!r} is not available here; use 'gloo' on CPUs "
                          "or 'nccl' with a CUDA build of torch")


def reduce_to_coordinator(backend: str, store: Store, rank: int, size: int,
                           buffer: torch.Tensor, timeout_s: float) -> None:
    """Sums `buffer` over the step's group into rank 0's `buffer`, in a group formed for
    this call only (a PrefixStore keeps its keys apart from the step's)."""
    group = _process_group(backend, PrefixStore("group/", store), rank, size, timeout_s)
    options = dist.ReduceOptions()
    options.rootRank, options.reduceOp = 0, dist.ReduceOp(dist.ReduceOp.SUM)
    group.reduce([buffer], options).wait()


def reduce_buffer(backend: str, flat: torch.Tensor) -> torch.Tensor:
    """`flat` as the final sum takes it: float32 (whatever the parameters' dtype, so the
    sum over members rounds no more than one process's), on the CPU for gloo and on
    the process's device for NCCL."""
    device = flat.device if backend == "nccl" else torch.device("cpu")
    return flat.to(device=device, dtype=torch.float32)


def _zero_buffer(backend: str, model: torch.nn.Module) -> torch.Tensor:
    """(P,) float32 zeros where `reduce_buffer` puts the coordinator's sum (no copy of
    the model's gradient made to size it)."""
    device = next(model.parameters()).device if backend == "nccl" else torch.device("cpu")
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    return torch.zeros(num_parameters, dtype=torch.float32, device=device)


def _flat_gradient(model: torch.nn.Module) -> torch.Tensor:
    """(P,) every parameter's gradient (zeros where it has none), flattened in order."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def _set_flat_gradient(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Each parameter's `.grad` from `flat`, in the parameter's dtype and on its device."""
    offset = 0
    for parameter in model.parameters():
        size = parameter.numel()
        piece = flat[offset:offset + size].view_as(parameter)
        parameter.grad = piece.to(device=parameter.device, dtype=parameter.dtype, copy=True)
        offset += size


class Coordinator:
    """Rank 0 of every elastic step; serves the store. One step is open at a time.

    Invariants: between `open_step` and `finish_step` (or `abort_step`) the policy's
    weights must not change (members train with the snapshot taken at `open_step`);
    each appended chunk holds whole groups, and no group is appended twice;
    `finish_step` replaces the policy's `.grad` with the step's normalised gradient.
    """

    def __init__(self, policy: PolicyModel, work_dir: str | Path | None = None,
                 backend: str = "gloo", timeout_s: float = 300.0):
        # `work_dir` is no longer written (everything travels through the store); it is
        # still accepted so that the pools' calls stay as they are.
        del work_dir
        self.policy, self.backend, self.timeout_s = policy, backend, timeout_s
        self.store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        self._step: int | None = None
        self._config: LossConfig | None = None
        self._num_micro_batches = self._num_chunks = self._count = 0
        self._aborted: tuple[PrefixStore, int] | None = None

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.store.port

    @property
    def step_open(self) -> bool:
        return self._step is not None

    def open_step(self, step: int, config: LossConfig) -> str:
        """Publishes the step's start weights and loss, opens its roster and its (empty)
        queue; returns the digest of the start weights."""
        if self._step is not None:
            raise MembershipError(f"step {self._step} is still open; finish it before "
                                  f"opening step {step}")
        if self._aborted is not None:
            self._remove_payloads(*self._aborted)
            self._aborted = None
        digest = weights_digest(self.policy.model)
        store = step_store(self.store, step)
        put_blob(store, "weights", encode_weights(self.policy.model))
        store.set("membership", OPEN)
        store.set("spec", json.dumps({"weights_digest": digest,
                                      "loss": dataclasses.asdict(config),
                                      "scoring": scoring_options(self.policy)}))
        self._step, self._config = step, config
        self._num_micro_batches = self._num_chunks = self._count = 0
        return digest

    def append(self, chunk: PackedStep) -> None:
        """Adds the micro-batches of `chunk` (the packed trees of whole, complete groups)
        to the step's queue, claimable at once."""
        step, config = self._open_step()
        store = step_store(self.store, step)
        put_blob(store, f"chunk/{self._num_chunks}", encode_step(chunk))
        self._count += step_count(config, chunk)
        for index in range(len(chunk.micro_batches)):
            store.set(f"mb/{self._num_micro_batches}",
                      json.dumps({"chunk": self._num_chunks, "index": index}))
            self._num_micro_batches += 1
        self._num_chunks += 1

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches appended to the open step so far."""
        return self._num_micro_batches

    def num_claimed(self) -> int:
        """Tickets drawn so far (may exceed the micro-batches appended: a member holding
        a ticket past the end of the queue waits for the next append)."""
        return self._open_store().add("next", 0)

    def members(self) -> list[str]:
        """Names on the roster, in rank order from rank 1."""
        value = self._open_store().get("membership").decode()
        names = value.split(":", 1)[1]
        return names.split(",") if names else []

    def finish_step(self) -> ElasticStepResult:
        """Closes the queue, waits until every micro-batch is claimed, closes the roster,
        sums the members' gradients, divides by the step's count into the policy's
        `.grad`, and returns what happened. Raises EmptyStepError (the step aborted) if
        no term was appended."""
        step = self._open_step()[0]
        store = step_store(self.store, step)
        if self._count == 0:
            self.abort_step()
            raise EmptyStepError(f"step {step}: no trainable token was appended; check "
                                 "that the gateway recorded completions")
        started_s = time.perf_counter()
        store.set(f"mb/{self._num_micro_batches}", END)
        self._wait(store, "drained")
        names = self._close_roster(store)
        store.set("world_size", str(len(names) + 1))
        drained_s = time.perf_counter()
        buffer = _zero_buffer(self.backend, self.policy.model)
        reduce_to_coordinator(self.backend, store, 0, len(names) + 1, buffer, self.timeout_s)
        reduced_s = time.perf_counter()
        _set_flat_gradient(self.policy.model, buffer / self._count)
        reports = [json.loads(store.get(f"report/{name}")) for name in names]
        # A late member is refused before reading them.
        self._remove_payloads(store, self._num_chunks)
        stats: dict[str, float] = {}
        for report in reports:
            merge_stats(stats, report["stats"])
        for key in ("loss", "loss_abs_sum"):
            if key in stats:
                stats[key] /= self._count
        result = ElasticStepResult(
            step=step, ranks=["coordinator", *names],
            claims={r["name"]: r["claimed"] for r in reports},
            weights_digests={r["name"]: r["weights_digest"] for r in reports},
            num_micro_batches=self._num_micro_batches, num_chunks=self._num_chunks,
            stats=stats, drain_s=drained_s - started_s, reduce_s=reduced_s - drained_s)
        self._step = None
        return result

    def abort_step(self) -> None:
        """Ends the open step without a gradient: the roster closes, the queue ends, and
        its members drop what they computed and wait for their next step."""
        store = self._open_store()
        self._close_roster(store)
        store.set(f"mb/{self._num_micro_batches}", END)
        store.set("world_size", "0")
        # Its members may still be reading them: they are freed when the next step opens.
        self._aborted = (store, self._num_chunks)
        self._step = None

    def close(self) -> None:
        """Stops serving the store (members still attached will time out)."""
        del self.store

    def _open_step(self) -> tuple[int, LossConfig]:
        """The open step's number and loss (`open_step` sets both)."""
        if self._step is None or self._config is None:
            raise MembershipError("no step is open; call open_step first")
        return self._step, self._config

    def _open_store(self) -> PrefixStore:
        return step_store(self.store, self._open_step()[0])

    @staticmethod
    def _remove_payloads(store: PrefixStore, num_chunks: int) -> None:
        """Frees a step's weights and chunks in the store (the small keys stay)."""
        delete_blob(store, "weights")
        for index in range(num_chunks):
            delete_blob(store, f"chunk/{index}")

    def _close_roster(self, store: PrefixStore) -> list[str]:
        while True:
            current = store.get("membership").decode()
            names = current.split(":", 1)[1]
            closed = CLOSED + names
            if store.compare_set("membership", current, closed).decode() == closed:
                return names.split(",") if names else []

    def _wait(self, store: PrefixStore, key: str) -> None:
        """Waits for `key`, failing fast if a member reported an error."""
        deadline = time.monotonic() + self.timeout_s
        while not store.check([key]):
            if store.check(["failed"]):
                raise MembershipError(f"step {self._step}: a member failed: "
                                      f"{store.get('failed').decode()}")
            if time.monotonic() > deadline:
                raise MembershipError(
                    f"step {self._step}: {key!r} not reached within {self.timeout_s} s "
                    f"(roster {self.members()}, {self.num_claimed()} tickets drawn of "
                    f"{self._num_micro_batches}); move a cell to training or raise timeout_s")
            time.sleep(POLL_S)


class Member:
    """One training cell's share of elastic steps, in its own process.

    Invariants: a member trains a step only if it is on the step's roster, and then
    only with that step's start weights; its gradient enters the step only if the
    roster closed with it on it; it holds no gradient between steps. It trains on
    `placement.device` in `learner.dtype`, as the plain run places its policy.
    """

    def __init__(self, address: tuple[str, int], name: str, model_dir: str | Path,
                 reference_dir: str | Path | None = None, backend: str = "gloo",
                 timeout_s: float = 300.0, learner: TrainConfig = CPU_LEARNER,
                 device_index: int | None = None):
        if "," in name or ":" in name:
            raise ValueError(f"member name {name!r} must not contain ',' or ':'")
        self.name, self.backend, self.timeout_s = name, backend, timeout_s
        self.store = TCPStore(address[0], address[1], is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        self.policy, self.reference, self.placement = load_member_policies(
            learner, model_dir, reference_dir, device_index)

    def join(self, step: int) -> bool:
        """Joins `step` (waiting up to `timeout_s` for it to open), trains what it
        claims and takes part in the final sum; False if the roster had already closed
        or the step was aborted."""
        store = step_store(self.store, step)
        store.wait(["spec"])
        rank = self._register(store)
        if rank is None:
            return False
        try:
            report = self._train(store)
        except Exception as error:
            store.set("failed", f"{self.name}: {type(error).__name__}: {error}")
            raise
        store.wait(["world_size"])
        world_size = int(store.get("world_size"))
        if world_size:
            store.set(f"report/{self.name}", json.dumps(report))
            reduce_to_coordinator(self.backend, store, rank, world_size,
                                   reduce_buffer(self.backend, _flat_gradient(self.policy.model)),
                                   self.timeout_s)
        self.policy.model.zero_grad(set_to_none=True)
        return world_size > 0

    def _register(self, store: PrefixStore) -> int | None:
        while True:
            current = store.get("membership").decode()
            if not current.startswith(OPEN):
                return None
            names = [n for n in current[len(OPEN):].split(",") if n]
            wanted = OPEN + ",".join([*names, self.name])
            if store.compare_set("membership", current, wanted).decode() == wanted:
                return len(names) + 1

    def _train(self, store: PrefixStore) -> dict[str, Any]:
        spec = json.loads(store.get("spec"))
        load_weights(self.policy.model, get_blob(store, "weights"))
        digest = weights_digest(self.policy.model)
        self.policy.model.zero_grad(set_to_none=True)
        config = LossConfig(**spec["loss"])
        use_scoring_options(spec["scoring"], self.policy, self.reference)
        chunks: dict[int, tuple[PackedStep, torch.Tensor]] = {}
        claimed, stats = [], {}
        while True:
            index = store.add("next", 1) - 1
            store.wait([f"mb/{index}"])
            entry = store.get(f"mb/{index}").decode()
            if entry == END:
                store.set(f"mb/{index + 1}", END)   # for whoever draws the next ticket
                store.set("drained", self.name)
                break
            where = json.loads(entry)
            if where["chunk"] not in chunks:
                chunk = self.placement.prepare(
                    decode_step(get_blob(store, f"chunk/{where['chunk']}")))
                chunks[where["chunk"]] = (chunk, chunk_weights(config, chunk))
            chunk, weights = chunks[where["chunk"]]
            with self.placement.compute():
                values = backward_micro_batch(self.policy, chunk, weights, where["index"],
                                              config, self.reference)
            merge_stats(stats, values)
            claimed.append(index)
        return {"name": self.name, "claimed": claimed, "stats": stats,
                "weights_digest": digest}


def use_gpu(learner: TrainConfig, device_index: int | None) -> None:
    """Makes cuda:`device_index` this process's (this thread's) current device when the
    member trains on CUDA, so that `sharding.place` puts it there; a member asked for
    CUDA where there is none is left to `place`, which says so naming learner.device."""
    wants_cuda = learner.device == "cuda" or (learner.device == "auto"
                                              and torch.cuda.is_available())
    if wants_cuda and device_index is not None and torch.cuda.is_available():
        torch.cuda.set_device(device_index)


def load_member_policies(learner: TrainConfig, model_dir: str | Path,
                         reference_dir: str | Path | None, device_index: int | None
                         ) -> tuple[PolicyModel, PolicyModel | None, Placement]:
    """A member's policy (and reference) loaded in `learner.dtype` and placed as the plain
    run places them (`sharding.place`: device, attention, activation checkpointing)."""
    use_gpu(learner, device_index)
    options = {"dtype": torch_dtype(learner.dtype),
               "head_chunk_tokens": learner.head_chunk_tokens}
    policy = PolicyModel.load(model_dir, **options)
    policy.model.train()
    reference = PolicyModel.load(reference_dir, **options) if reference_dir else None
    return policy, reference, place(learner, policy, reference)


def member_main(address: tuple[str, int], name: str, model_dir: str,
                inbox: Any, reference_dir: str | None = None, backend: str = "gloo",
                timeout_s: float = 300.0, num_threads: int = 1,
                learner: TrainConfig = CPU_LEARNER, device_index: int | None = None) -> None:
    """A training cell's process: joins each step number it reads from `inbox` (a
    multiprocessing queue) until it reads None. Start it with the "spawn" context."""
    torch.set_num_threads(num_threads)
    member = Member(address, name, model_dir, reference_dir, backend, timeout_s, learner,
                    device_index)
    while (step := inbox.get()) is not None:
        member.join(step)
