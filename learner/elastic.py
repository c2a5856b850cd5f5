"""A training step whose data-parallel membership grows while it runs (issue 7).

QwenGyre moves cells from rollout to training one at a time while a step is already
training, so the learner cannot fix its data-parallel group up front. This module runs
one step of `objective.backward_step` across a membership that grows between
micro-steps, and sums the gradient so that it equals the single-process one.

Roles, all on one `torch.distributed.TCPStore` that the coordinator serves on
127.0.0.1 with a port chosen by the OS (`Coordinator.address`):

- The **coordinator** (the learner's main process, rank 0) owns the step: it writes
  the step's start weights and its packed micro-batches to one file, opens a roster
  and a claim queue in the store, and at the end receives the summed gradient into
  its policy's `.grad`, ready for clipping and the optimizer.
- A **member** (one process per training cell, long-lived: `member_main`) joins a step
  whenever its cell arrives in training: it adds itself to the roster (an atomic
  `compare_set` on a list of names, so its rank is its join order), loads the step's
  start weights (which are the current weights: the optimizer only steps after the
  reduction) and claims micro-batches by drawing tickets from a counter
  (`add("next", 1)`: each ticket is handed out once, so each micro-batch is trained
  exactly once), accumulating their gradients.
- When the last ticket has been drawn the coordinator closes the roster (the same
  atomic `compare_set`; a member arriving later is refused and waits for the next
  step), and the coordinator and the members on the closed roster form one process
  group for this step only and `reduce` (sum) their flattened gradients to rank 0.

Why a fresh group per step and no collective before the end: torch.distributed cannot
grow a group in place, and re-forming one at every join would stop every member at a
barrier. Nothing during the step needs a collective: the micro-batches are
independent, the claim queue lives in the store, and the weights are constant until
the optimizer steps, so a joiner reads the step's start snapshot (a file here; on GPUs
it could equally be a broadcast from rank 0 in the end-of-step group of the previous
step). Only the final sum needs a group, and by then the membership is fixed.

Why the sum is exact: the losses weight every term by a normaliser counted over the
whole step (`losses.step_weights`), never per micro-batch, so the step's gradient is
the sum of the micro-batches' gradients, whoever computed them. Only the order of the
float additions differs from one process accumulating them all.

Micro-batches become claimable when the coordinator releases them (`release`; all at
`open_step` by default). A member holding a ticket that is not yet released waits for
it. This lets the learner hand out work as it goes, and lets tests pace the members
deterministically. The packed step itself is fixed when the step opens, since the
normalisers need all of its terms.

Backends: "gloo" (CPU, tested here) and "nccl" (GPU; the gradient buffer then lives on
the member's device). Everything else is backend-independent.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from undertow.learner.errors import LearnerError
from undertow.learner.losses import LossConfig, micro_batch_loss, step_weights
from undertow.learner.model import PolicyModel
from undertow.learner.packing import PackedStep

HOST = "127.0.0.1"
POLL_S = 0.02
OPEN, CLOSED = "open:", "closed:"


class MembershipError(LearnerError):
    """A member failed, or the step did not finish within its timeout."""


@dataclass
class ElasticStepResult:
    """What one elastic step did. `claims[name]` are the micro-batch indices member
    `name` trained (together a partition of range(num_micro_batches));
    `weights_digests[name]` is the digest of the weights it trained with; `ranks` lists
    the members in rank order (rank 0 is the coordinator); `stats` are summed over
    members as `backward_step` sums them over micro-batches."""

    step: int
    ranks: list[str]
    claims: dict[str, list[int]]
    weights_digests: dict[str, str]
    stats: dict[str, float] = field(default_factory=dict)


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over the parameters' names and bytes, in `named_parameters` order."""
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _step_store(store: dist.Store, step: int) -> dist.PrefixStore:
    return dist.PrefixStore(f"step/{step}/", store)


def _process_group(backend: str, store: dist.Store, rank: int, size: int,
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


def _reduce_to_coordinator(backend: str, store: dist.Store, rank: int, size: int,
                           buffer: torch.Tensor, timeout_s: float) -> None:
    """Sums `buffer` over the step's group into rank 0's `buffer`, in a group formed for
    this call only (a PrefixStore keeps its keys apart from the step's)."""
    group = _process_group(backend, dist.PrefixStore("group/", store), rank, size, timeout_s)
    options = dist.ReduceOptions()
    options.rootRank, options.reduceOp = 0, dist.ReduceOp.SUM
    group.reduce([buffer], options).wait()


def _flat_gradient(model: torch.nn.Module) -> torch.Tensor:
    """(P,) every parameter's gradient (zeros where it has none), flattened in order."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def _set_flat_gradient(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for parameter in model.parameters():
        size = parameter.numel()
        parameter.grad = flat[offset:offset + size].view_as(parameter).clone()
        offset += size


class Coordinator:
    """Rank 0 of every elastic step; serves the store. One step is open at a time.

    Invariants: between `open_step` and `finish_step` the policy's weights must not
    change (members train with the snapshot taken at `open_step`); `finish_step`
    replaces the policy's `.grad` with the step's summed gradient.
    """

    def __init__(self, policy: PolicyModel, work_dir: str | Path, backend: str = "gloo",
                 timeout_s: float = 300.0):
        self.policy, self.backend, self.timeout_s = policy, backend, timeout_s
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self._step: int | None = None
        self._num_micro_batches = 0
        self._num_released = 0

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.store.port

    def open_step(self, step: int, packed: PackedStep, config: LossConfig,
                  num_released: int | None = None) -> str:
        """Publishes the step (start weights, micro-batches, loss config) and opens its
        roster and queue; returns the digest of the start weights."""
        if self._step is not None:
            raise MembershipError(f"step {self._step} is still open; finish it before "
                                  f"opening step {step}")
        path = self.work_dir / f"step-{step}.pt"
        torch.save({"weights": self.policy.model.state_dict(), "packed": packed,
                    "loss": dataclasses.asdict(config)}, path)
        digest = weights_digest(self.policy.model)
        store = _step_store(self.store, step)
        store.set("membership", OPEN)
        store.set("num_micro_batches", str(len(packed.micro_batches)))
        store.set("spec", json.dumps({"path": str(path), "weights_digest": digest}))
        self._step, self._num_micro_batches, self._num_released = \
            step, len(packed.micro_batches), 0
        self.release(len(packed.micro_batches) if num_released is None else num_released)
        return digest

    def release(self, num: int) -> None:
        """Makes micro-batches [0, num) claimable (never takes a release back)."""
        store = self._open_store()
        for index in range(self._num_released, min(num, self._num_micro_batches)):
            store.set(f"released/{index}", "1")
        self._num_released = max(self._num_released, min(num, self._num_micro_batches))

    def num_claimed(self) -> int:
        """Tickets drawn so far (may exceed the number of micro-batches: a member
        learns that the queue is empty by drawing a ticket past its end)."""
        return self._open_store().add("next", 0)

    def members(self) -> list[str]:
        """Names on the roster, in rank order from rank 1."""
        value = self._open_store().get("membership").decode()
        names = value.split(":", 1)[1]
        return names.split(",") if names else []

    def finish_step(self) -> ElasticStepResult:
        """Waits until every micro-batch is claimed, closes the roster, sums the
        members' gradients into the policy's `.grad`, and returns what happened."""
        step, store = self._step, self._open_store()
        if self._num_released < self._num_micro_batches:
            self.release(self._num_micro_batches)
        self._wait(store, "drained")
        names = self._close_roster(store)
        store.set("world_size", str(len(names) + 1))
        buffer = torch.zeros_like(_flat_gradient(self.policy.model))
        _reduce_to_coordinator(self.backend, store, 0, len(names) + 1, buffer, self.timeout_s)
        _set_flat_gradient(self.policy.model, buffer)
        reports = [json.loads(store.get(f"report/{name}")) for name in names]
        (self.work_dir / f"step-{step}.pt").unlink()   # a late member is refused before reading it
        self._step = None
        stats: dict[str, float] = {}
        for report in reports:
            for key, value in report["stats"].items():
                stats[key] = stats.get(key, 0.0) + value
        return ElasticStepResult(
            step=step, ranks=["coordinator", *names],
            claims={r["name"]: r["claimed"] for r in reports},
            weights_digests={r["name"]: r["weights_digest"] for r in reports}, stats=stats)

    def close(self) -> None:
        """Stops serving the store (members still attached will time out)."""
        del self.store

    def _open_store(self) -> dist.PrefixStore:
        if self._step is None:
            raise MembershipError("no step is open; call open_step first")
        return _step_store(self.store, self._step)

    def _close_roster(self, store: dist.PrefixStore) -> list[str]:
        while True:
            current = store.get("membership").decode()
            names = current[len(OPEN):]
            closed = CLOSED + names
            if store.compare_set("membership", current, closed).decode() == closed:
                return names.split(",") if names else []

    def _wait(self, store: dist.PrefixStore, key: str) -> None:
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

    Invariants: a member trains a step only if it is on the step's closed roster, and
    then only with that step's start weights; it holds no gradient between steps.
    """

    def __init__(self, address: tuple[str, int], name: str, model_dir: str | Path,
                 reference_dir: str | Path | None = None, backend: str = "gloo",
                 timeout_s: float = 300.0):
        if "," in name or ":" in name:
            raise ValueError(f"member name {name!r} must not contain ',' or ':'")
        self.name, self.backend, self.timeout_s = name, backend, timeout_s
        self.store = dist.TCPStore(address[0], address[1], is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.policy = PolicyModel.load(model_dir)
        self.policy.model.train()
        self.reference = PolicyModel.load(reference_dir) if reference_dir else None

    def join(self, step: int) -> bool:
        """Joins `step` (waiting up to `timeout_s` for it to open), trains what it
        claims and takes part in the final sum; False if the roster had already closed."""
        store = _step_store(self.store, step)
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
        store.set(f"report/{self.name}", json.dumps(report))
        buffer = _flat_gradient(self.policy.model)
        _reduce_to_coordinator(self.backend, store, rank, int(store.get("world_size")),
                               buffer, self.timeout_s)
        self.policy.model.zero_grad(set_to_none=True)
        return True

    def _register(self, store: dist.PrefixStore) -> int | None:
        while True:
            current = store.get("membership").decode()
            if not current.startswith(OPEN):
                return None
            names = [n for n in current[len(OPEN):].split(",") if n]
            wanted = OPEN + ",".join([*names, self.name])
            if store.compare_set("membership", current, wanted).decode() == wanted:
                return len(names) + 1

    def _train(self, store: dist.PrefixStore) -> dict[str, Any]:
        spec = json.loads(store.get("spec"))
        saved = torch.load(spec["path"], weights_only=False)
        self.policy.model.load_state_dict(saved["weights"])
        digest = weights_digest(self.policy.model)
        self.policy.model.zero_grad(set_to_none=True)
        packed: PackedStep = saved["packed"]
        config = LossConfig(**saved["loss"])
        weights = step_weights(config, packed)
        num_micro_batches = len(packed.micro_batches)
        claimed, stats = [], {}
        while (index := store.add("next", 1) - 1) < num_micro_batches:
            if index == num_micro_batches - 1:
                store.set("drained", self.name)
            store.wait([f"released/{index}"])
            for key, value in self._train_micro_batch(packed, config, weights, index).items():
                stats[key] = stats.get(key, 0.0) + value
            claimed.append(index)
        return {"name": self.name, "claimed": claimed, "stats": stats,
                "weights_digest": digest}

    def _train_micro_batch(self, packed: PackedStep, config: LossConfig,
                           weights: torch.Tensor, index: int) -> dict[str, float]:
        """One iteration of `objective.backward_step`'s loop, for micro-batch `index`."""
        micro_batch = packed.micro_batches[index]
        scores = self.policy.score(micro_batch, with_entropy=bool(config.entropy_coef))
        ref_logprobs = None
        if config.kl_coef:
            if self.reference is None:
                raise MembershipError("LossConfig.kl_coef > 0 needs the member to be started "
                                      "with reference_dir")
            with torch.no_grad():
                ref_logprobs = self.reference.score(micro_batch).logprobs
        loss, stats = micro_batch_loss(config, packed, micro_batch, weights, scores.logprobs,
                                       scores.entropy, ref_logprobs)
        loss.backward()
        return stats


def member_main(address: tuple[str, int], name: str, model_dir: str,
                inbox: Any, reference_dir: str | None = None, backend: str = "gloo",
                timeout_s: float = 300.0, num_threads: int = 1) -> None:
    """A training cell's process: joins each step number it reads from `inbox` (a
    multiprocessing queue) until it reads None. Start it with the "spawn" context."""
    torch.set_num_threads(num_threads)
    member = Member(address, name, model_dir, reference_dir, backend, timeout_s)
    while (step := inbox.get()) is not None:
        member.join(step)
