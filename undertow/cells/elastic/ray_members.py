"""The Ray backend's training side: each training cell's learner members as Ray actors in
one placement group (docs/cluster.md, "Ray members").
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from undertow.cells.elastic.local import member_name
from undertow.cells.errors import CellPoolError

if TYPE_CHECKING:   # the learner's modules import torch: for the annotations only
    from undertow.learner.config import TrainConfig

# What a member or an engine asks of its cell's resource: a sliver, so that the actors
# of a cell (its members and its engine host) all fit on the node that declares it.
PIN_AMOUNT = 0.01


def cell_resource(cell_id: int) -> str:
    """The custom Ray resource that marks where cell `cell_id`'s devices are."""
    return f"undertow-cell-{cell_id}"


def pinned_resources(cell_id: int) -> dict[str, float]:
    """`{cell_resource(cell_id): PIN_AMOUNT}` when a node of the connected cluster
    declares that resource, else {} (the cell may then run on any node)."""
    import ray

    name = cell_resource(cell_id)
    return {name: PIN_AMOUNT} if ray.cluster_resources().get(name, 0) > 0 else {}


@dataclass(frozen=True)
class RayCell:
    """What one cell asks of the cluster while it trains.

    Invariants: `num_members >= 1`; every amount is >= 0 and a member asks for some
    resource (Ray cannot place an empty bundle); the group needs
    `num_members * (per-member amounts)` on one node.
    """

    num_members: int = 1
    num_gpus_per_member: float = 0.0
    num_cpus_per_member: float = 1.0
    resources_per_member: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_members < 1:
            raise ValueError(f"RayCell.num_members={self.num_members}; a cell has >= 1 member")
        if min(self.bundle().values(), default=0.0) < 0 or not any(self.bundle().values()):
            raise ValueError(f"RayCell asks for {self.bundle()}; give each member a positive "
                             "amount of CPU, GPU or a custom resource, and no negative one")

    def bundle(self) -> dict[str, float]:
        """One member's share, as a placement-group bundle (zero amounts left out)."""
        amounts = {"CPU": self.num_cpus_per_member, "GPU": self.num_gpus_per_member,
                   **self.resources_per_member}
        return {name: float(amount) for name, amount in amounts.items() if amount}

    def member_names(self, cell_id: int) -> list[str]:
        """The group's names on the elastic roster: `member_name(c)` for a one-member
        cell (as in the local backend), `member_name(c).i` for larger groups."""
        if self.num_members == 1:
            return [member_name(cell_id)]
        return [f"{member_name(cell_id)}.{index}" for index in range(self.num_members)]


class MemberActor:
    """The body of one member actor (wrapped with `ray.remote` by `RayMembers`)."""

    def __init__(self, address: tuple[str, int], name: str, model_dir: str, timeout_s: float,
                 num_threads: int, member_options: dict[str, Any]):
        import torch

        from undertow.cells.elastic.step import Member

        torch.set_num_threads(num_threads)
        self.member = Member(address, name, model_dir, timeout_s=timeout_s, **member_options,
                             device_index=actor_device_index(member_options.get("learner")))

    def join(self, step: int) -> bool:
        return self.member.join(step)

    def placement(self) -> dict[str, Any]:
        """Where Ray put this member: its process, node and accelerator ids."""
        import ray

        context = ray.get_runtime_context()
        return {"name": self.member.name, "pid": os.getpid(), "node_id": context.get_node_id(),
                "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()]}


def actor_device_index(learner: TrainConfig | None) -> int | None:
    """The CUDA index of the GPU Ray assigned this actor, or None when its member does
    not train on CUDA (no `learner`, or a CPU one)."""
    if learner is None or learner.device != "cuda":
        return None
    import ray

    from undertow.cells.elastic.devices import assigned_device_index

    return assigned_device_index([str(gpu) for gpu in ray.get_gpu_ids()],
                                 os.environ.get("CUDA_VISIBLE_DEVICES"))


@dataclass
class _Group:
    """A started cell: its placement group, actors (in member order), their placement
    reports (asked for first, as an actor answers its calls in order) and queued joins."""

    placement_group: Any
    actors: list[Any]
    placements: list[Any]
    pending: list[Any] = field(default_factory=list)


class RayMembers:
    """Each training cell's members as one Ray actor group (same protocol as
    `local.ThreadMembers`). Needs a connected Ray (`ray.init` or `local_cluster`).

    Invariants: a cell has a group exactly between `start` and `stop`; `stop` and
    `close` always remove the group's actors and placement group, so the cell's
    resources are free again whatever happened inside.
    """

    def __init__(self, address: tuple[str, int], model_dir: str | Path,
                 cells: Mapping[int, RayCell] | RayCell = RayCell(), timeout_s: float = 300.0,
                 placement_timeout_s: float = 60.0, num_threads: int = 1,
                 **member_options: Any):
        import ray

        if not ray.is_initialized():
            raise CellPoolError("RayMembers needs a running Ray: call ray.init(address=...) or "
                                "use ray_members.local_cluster() first")
        from undertow.cells.elastic.devices import member_learner, with_learner

        self.address, self.model_dir, self.timeout_s = address, str(model_dir), timeout_s
        self.cells, self.placement_timeout_s = cells, placement_timeout_s
        self.num_threads = num_threads
        self.member_options = with_learner(member_options, member_learner(member_options))
        self.actor_class = ray.remote(max_restarts=0)(MemberActor)
        self.groups: dict[int, _Group] = {}

    def cell(self, cell_id: int) -> RayCell:
        return self.cells if isinstance(self.cells, RayCell) else self.cells[cell_id]

    def start(self, cell_id: int) -> None:
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if cell_id in self.groups:
            raise CellPoolError(f"cell {cell_id} already has members; stop them first")
        cell = self.cell(cell_id)
        group = placement_group([cell.bundle()] * cell.num_members, strategy="STRICT_PACK",
                                name=f"undertow-{member_name(cell_id)}")
        if not group.wait(self.placement_timeout_s):
            remove_placement_group(group)
            raise CellPoolError(
                f"Ray could not place cell {cell_id} ({cell.num_members} x {cell.bundle()} on "
                f"one node) within {self.placement_timeout_s} s; the cluster has "
                f"{_available()} free: declare the resources (ray start --num-gpus/--resources) "
                "or move another cell out of training first")
        # Ray handles are Any here: ray is imported only when used, so MemberActor's
        # methods cannot carry `ray.method`'s typed `.remote`.
        actors: list[Any] = [
            self.actor_class.options(
                num_cpus=cell.num_cpus_per_member, num_gpus=cell.num_gpus_per_member,
                resources=dict(cell.resources_per_member),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=index),
            ).remote(self.address, name, self.model_dir, self.timeout_s, self.num_threads,
                     self.member_options)
            for index, name in enumerate(cell.member_names(cell_id))]
        self.groups[cell_id] = _Group(group, actors,
                                      [actor.placement.remote() for actor in actors])

    def join(self, cell_id: int, step: int) -> None:
        group = self.groups[cell_id]
        group.pending.extend(actor.join.remote(step) for actor in group.actors)

    def stop(self, cell_id: int) -> None:
        """Waits up to `timeout_s` for the cell's queued steps, then ends its group."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        group = self.groups.pop(cell_id)
        try:
            ray.get(group.pending, timeout=self.timeout_s)
        except GetTimeoutError as error:
            raise CellPoolError(f"the members of cell {cell_id} did not finish within "
                                f"{self.timeout_s} s and were killed") from error
        except RayError as error:
            raise CellPoolError(f"the members of cell {cell_id} failed: {error}") from error
        finally:
            _remove(group)

    def placements(self, cell_id: int) -> list[dict[str, Any]]:
        """Where each member of a started cell runs (waits for the actors to be up)."""
        import ray

        return ray.get(self.groups[cell_id].placements, timeout=self.timeout_s)

    def close(self) -> None:
        """Ends every group at once, without waiting for their steps and without raising."""
        groups, self.groups = self.groups, {}
        for group in groups.values():
            _remove(group)


def _remove(group: _Group) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in group.actors:
        ray.kill(actor, no_restart=True)
    remove_placement_group(group.placement_group)


def _available() -> dict[str, float]:
    import ray

    return {name: amount for name, amount in ray.available_resources().items()
            if not name.startswith(("node:", "memory", "object_store_memory"))}


@functools.cache
def process_token() -> str:
    """The auth token of every local Ray this process starts, drawn once: Ray's client
    keeps the first token it read for the life of the process, so a second local instance
    with a new token would refuse this process's own connection."""
    return secrets.token_hex(16)


@contextlib.contextmanager
def local_cluster(temp_dir: str | Path, num_cpus: int, num_gpus: int = 0,
                  resources: Mapping[str, float] | None = None,
                  object_store_bytes: int = 100 * 2**20) -> Iterator[dict[str, Any]]:
    """A Ray instance on this machine for the duration of the block; yields the node
    (`ray.nodes()[0]`). `num_gpus` and `resources` are declared, not detected, so a CPU
    machine can stand in for a GPU cluster's scheduling.

    Ray reads its settings from the environment of the processes it starts, so this sets,
    for the block only: RAY_USAGE_STATS_ENABLED=0 (no reporting), RAY_AUTH_MODE=token with
    this process's RAY_AUTH_TOKEN (`process_token`; nothing written to ~/.ray), and
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which makes Ray bind its node to 127.0.0.1; Ray
    reads that last one when it is first imported, so it takes effect only if this
    process has not imported ray yet.
    """
    settings = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": process_token(),
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        import ray

        if ray.is_initialized():
            raise CellPoolError("Ray is already initialised in this process; call "
                                "ray.shutdown() first or use the running instance")
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, resources=dict(resources or {}),
                 include_dashboard=False, _temp_dir=str(Path(temp_dir).resolve()),
                 object_store_memory=object_store_bytes)
        try:
            yield ray.nodes()[0]
        finally:
            ray.shutdown()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def connect(address: str, temp_dir: str | Path, num_cpus: int) -> Iterator[None]:
    """Ray for the duration of the block: the cluster at `address` ("auto" or
    "HOST:PORT", as `ray.init(address=...)` takes it), or, with "", a one-machine
    instance of `num_cpus` CPUs with its files under `temp_dir` (`local_cluster`). At the
    end this process disconnects (a local instance stops), which ends every actor it
    started that is still alive."""
    if not address:
        with local_cluster(temp_dir, num_cpus=num_cpus):
            yield
        return
    import ray

    if ray.is_initialized():
        raise CellPoolError("Ray is already initialised in this process; call "
                            "ray.shutdown() first or use the running instance")
    try:
        ray.init(address=address)
    except ConnectionError as error:
        raise CellPoolError(f"no Ray cluster at pool.ray_address={address!r} ({error}); "
                            "start one with `ray start --head` or leave pool.ray_address "
                            "empty for a one-machine Ray") from error
    try:
        yield
    finally:
        ray.shutdown()
