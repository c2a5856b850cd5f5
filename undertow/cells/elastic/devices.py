"""Which device each training member of the elastic pool trains on, and the checks before
any member starts (docs/cluster.md, "Member devices").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from undertow.cells.errors import CellPoolError
from undertow.learner.config import TrainConfig
from undertow.learner.sharding import DeviceError


class MemberDeviceError(CellPoolError, DeviceError, ValueError):
    """A training member cannot get the device the run config asks for. Also a
    ValueError: it is a run config value this node cannot honour, so the command line
    prints it as one line, as it prints every bad value."""


def member_device_name(device: str, cuda_available: bool) -> str:
    """`learner.device` as members get it: "auto" resolved here to "cuda" or "cpu"."""
    if device == "auto":
        return "cuda" if cuda_available else "cpu"
    return device


def check_member_devices(device: str, cuda_available: bool, num_gpus: int,
                         processes_per_cell: int = 1) -> None:
    """MemberDeviceError when `learner.device` (`device`) cannot be honoured by the pool
    on a node that sees `num_gpus` GPUs: CUDA asked for and absent, or a sharded cell of
    more processes than GPUs (each process of a cell needs a GPU of its own)."""
    wanted = member_device_name(device, cuda_available)
    if wanted != "cuda":
        return
    if not cuda_available or num_gpus < 1:
        raise MemberDeviceError(
            "learner.device is 'cuda' but torch sees no CUDA device on this node; install a "
            "CUDA build of torch, check CUDA_VISIBLE_DEVICES, or set learner.device: auto "
            "(or cpu)")
    if processes_per_cell > num_gpus:
        raise MemberDeviceError(
            f"pool.processes_per_cell={processes_per_cell} asks for {processes_per_cell} GPUs "
            f"per cell but this node has {num_gpus}; set pool.processes_per_cell <= "
            f"{num_gpus}")


def local_device_index(cell_id: int, rank: int, processes_per_cell: int,
                       num_visible: int) -> int:
    """The CUDA index (among the visible GPUs) of process `rank` of cell `cell_id` on
    this machine: cells take consecutive blocks of `processes_per_cell` GPUs, wrapping
    around `num_visible`; a block never wraps inside itself."""
    if num_visible < 1:
        raise MemberDeviceError("no GPU is visible to this process; check "
                                "CUDA_VISIBLE_DEVICES or set learner.device: cpu")
    if processes_per_cell > num_visible:
        raise MemberDeviceError(
            f"pool.processes_per_cell={processes_per_cell} asks for more GPUs than the "
            f"{num_visible} visible here")
    num_blocks = num_visible // processes_per_cell
    return (cell_id % num_blocks) * processes_per_cell + rank


def assigned_device_index(assigned: Sequence[str], visible: str | None) -> int:
    """The CUDA index of the first GPU Ray assigned this actor (`ray.get_gpu_ids()`, as
    strings) among `visible` (the actor's CUDA_VISIBLE_DEVICES; None or "" when unset:
    every GPU is visible, numbered as Ray numbers them)."""
    if not assigned:
        raise MemberDeviceError(
            "Ray assigned this member no GPU but learner.device is 'cuda'; set "
            "pool.gpus_per_member > 0 (or leave it unset) and declare the nodes' GPUs")
    first = str(assigned[0])
    if not visible:
        return int(first)
    ids = [part.strip() for part in visible.split(",") if part.strip()]
    if first not in ids:
        raise MemberDeviceError(f"Ray assigned GPU {first} but CUDA_VISIBLE_DEVICES is "
                                f"{visible!r}; do not override it for the members")
    return ids.index(first)


def check_cell_gpus(num_gpus_per_member: float, node_gpus: Sequence[float],
                    num_members: int = 1) -> None:
    """MemberDeviceError when no node of the cluster (`node_gpus`: each live node's GPU
    count) holds a cell of `num_members` members of `num_gpus_per_member` GPUs each
    (a cell is packed on one node)."""
    needed = num_gpus_per_member * num_members
    if needed <= 0:
        return
    most = max(node_gpus, default=0.0)
    if needed > most:
        raise MemberDeviceError(
            f"a training cell asks for {needed:g} GPUs (pool.gpus_per_member="
            f"{num_gpus_per_member:g}) but the largest node of the cluster has {most:g}; "
            "lower pool.gpus_per_member, add GPUs to a node (ray start --num-gpus), or set "
            "learner.device: cpu")


def member_learner(member_options: dict[str, Any], processes_per_cell: int = 1
                   ) -> TrainConfig | None:
    """The `learner` member option, checked for this node's devices (before any member
    starts, `check_member_devices`) and with "auto" resolved; None when the members were
    given none (they then train in float32 on the CPU)."""
    import torch

    learner = member_options.get("learner")
    if learner is None:
        return None
    available = torch.cuda.is_available()
    check_member_devices(learner.device, available, torch.cuda.device_count() if available
                         else 0, processes_per_cell)
    return dataclasses.replace(learner, device=member_device_name(learner.device, available))


def with_learner(member_options: dict[str, Any], learner: TrainConfig | None
                 ) -> dict[str, Any]:
    """The member options with the checked `learner` in place of the given one."""
    return {**member_options, **({"learner": learner} if learner is not None else {})}


def process_device_index(learner: TrainConfig | None, cell_id: int, rank: int = 0,
                         processes_per_cell: int = 1) -> int | None:
    """The GPU of process `rank` of cell `cell_id` on this machine
    (`local_device_index` over the GPUs torch sees), or None off CUDA."""
    if learner is None or learner.device != "cuda":
        return None
    import torch

    return local_device_index(cell_id, rank, processes_per_cell, torch.cuda.device_count())
