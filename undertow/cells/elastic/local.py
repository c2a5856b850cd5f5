"""The cells of this machine: their roles, switched as the policy decides, and the learner
members of the training cells (docs/cluster.md).

`CellRoles` keeps each cell's role (the transition table of `cell.py`) and carries out the
policy's role decisions through two small interfaces: `EngineSlots` (the rollout side,
`pool.GatewayEngineSlots` in `undertow train`) and `MemberSlots` (the training side:
`ProcessMembers`, `ThreadMembers` here, `ray_members.RayMembers`). A cell that arrives in
training while a step is open joins it between micro-steps.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from undertow.cells.cell import Cell, Role, change_role, finish_switch
from undertow.cells.errors import CellPoolError
from undertow.cells.state import (
    BatchProgress,
    Decision,
    MoveToRollout,
    MoveToTraining,
    PoolState,
    StartTraining,
)


class EngineSlots(Protocol):
    """The rollout side of the cells: `drain(cell_id)` stops new calls to the cell's
    engine, hands its sessions to other engines and stops it; `serve(cell_id,
    weight_version)` starts it again on the newest weights."""

    def drain(self, cell_id: int) -> None: ...

    def serve(self, cell_id: int, weight_version: int) -> None: ...


class MemberSlots(Protocol):
    """The training side: `start(cell_id)` starts the cell's learner member, `join(cell_id,
    step)` sends it into an elastic step (it waits there until the learner opens the step
    through its `step.Coordinator`), `stop(cell_id)` ends it once it has finished its step."""

    def start(self, cell_id: int) -> None: ...

    def join(self, cell_id: int, step: int) -> None: ...

    def stop(self, cell_id: int) -> None: ...


def member_name(cell_id: int) -> str:
    """The name a cell's member takes on the elastic step's roster."""
    return f"cell-{cell_id}"


class CellRoles:
    """The cells of this machine and their roles; carries out the policy's role decisions
    (the loop carries out `DispatchBatch`, which launches groups).

    Invariants: `cells` follow `cell.TRANSITIONS` only; a cell has a running member
    exactly while it is in training; `open_step` is the step being trained (None
    between steps), and every training cell has been sent into it.
    """

    def __init__(self, cells: list[Cell], engines: EngineSlots, members: MemberSlots,
                 weight_version: int = 0):
        self.cells = {cell.cell_id: cell for cell in cells}
        self.engines, self.members = engines, members
        self.weight_version = weight_version
        self.open_step: int | None = None
        for cell in cells:
            if cell.role is not Role.ROLLOUT:
                raise CellPoolError(f"cell {cell.cell_id} starts in {cell.role.value}; "
                                    "every cell starts in rollout")

    def update_sessions(self, num_sessions: dict[int, int]) -> None:
        """The gateway's count of live sessions on each rollout cell's engine."""
        for cell_id, num in num_sessions.items():
            cell = self.cells[cell_id]
            if cell.role is not Role.ROLLOUT and num:
                raise CellPoolError(f"cell {cell_id} is in {cell.role.value}; it holds no sessions")
            self._set(Cell(cell_id, cell.role, cell.num_session_slots, num, cell.heading))

    def snapshot(self, batches: tuple[BatchProgress, ...], num_steps: int) -> PoolState:
        """The state the policy reads, with the rollout runner's batch progress."""
        return PoolState(tuple(self.cells[i] for i in sorted(self.cells)), batches,
                         self.weight_version, num_steps)

    def carry_out(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            if isinstance(decision, MoveToTraining):
                self._move_to_training(decision.cell_id)
            elif isinstance(decision, MoveToRollout):
                self._move_to_rollout(decision.cell_id)
            elif isinstance(decision, StartTraining):
                self._start_training(decision.step)
            else:
                raise CellPoolError(f"{decision!r} is not a role decision; the run's loop "
                                    "carries out DispatchBatch (`loop.RunLoop`)")

    def step_published(self, step: int) -> None:
        """The learner published the weights of `step`; its members are free again."""
        if self.open_step != step:
            raise CellPoolError(f"step {step} is not the open step ({self.open_step})")
        self.open_step, self.weight_version = None, step + 1

    def _move_to_training(self, cell_id: int) -> None:
        self._set(change_role(self.cells[cell_id], Role.SWITCHING, heading=Role.TRAINING))
        self.engines.drain(cell_id)
        self._set(finish_switch(self.cells[cell_id]))
        self.members.start(cell_id)
        if self.open_step is not None:
            self.members.join(cell_id, self.open_step)

    def _move_to_rollout(self, cell_id: int) -> None:
        self._set(change_role(self.cells[cell_id], Role.SWITCHING, heading=Role.ROLLOUT))
        self.members.stop(cell_id)
        self.engines.serve(cell_id, self.weight_version)
        self._set(finish_switch(self.cells[cell_id]))

    def _start_training(self, step: int) -> None:
        if self.open_step is not None:
            raise CellPoolError(f"step {self.open_step} is still open; cannot start step {step}")
        self.open_step = step
        for cell in self.cells.values():
            if cell.role is Role.TRAINING:
                self.members.join(cell.cell_id, step)

    def _set(self, cell: Cell) -> None:
        self.cells[cell.cell_id] = cell


@dataclass
class _RunningMember:
    """A cell's member processes (one, or the cell's sharded processes in rank order),
    one inbox each, and the store of the cell's rendezvous (None for one process),
    served here for as long as the member runs."""

    processes: list[Any]
    inboxes: list[Any]
    cell_store: Any = None


class ProcessMembers:
    """Each cell's member in its own process ("spawn"), fed step numbers by a queue; with
    `processes_per_cell` > 1, a cell's member is that many processes, one FSDP2 mesh
    (gloo on CPUs, NCCL on GPUs: `sharded_cell.cell_main`), each fed the same step numbers.

    Invariants: a running cell has all its processes started and one inbox per process;
    a sharded cell's processes leave together (each ends on None, or on its step's
    timeout when another of them failed)."""

    def __init__(self, address: tuple[str, int], model_dir: str | Path,
                 timeout_s: float = 300.0, processes_per_cell: int = 1, **member_options: Any):
        import torch.multiprocessing

        from undertow.cells.elastic.devices import member_learner, with_learner

        if processes_per_cell < 1:
            raise CellPoolError(f"processes_per_cell must be >= 1, got {processes_per_cell}")
        if processes_per_cell > 1 and member_options.get("reference_dir"):
            raise CellPoolError("a sharded cell (processes_per_cell > 1) does not score a KL "
                                "reference model; set loss.kl_coef to 0 or "
                                "pool.processes_per_cell to 1")
        self.address, self.model_dir, self.timeout_s = address, str(model_dir), timeout_s
        self.processes_per_cell = processes_per_cell
        self.learner = member_learner(member_options, processes_per_cell)
        self.member_options = with_learner(member_options, self.learner)
        self.context = torch.multiprocessing.get_context("spawn")
        self.running: dict[int, _RunningMember] = {}

    def start(self, cell_id: int) -> None:
        if self.processes_per_cell > 1:
            self.running[cell_id] = self._start_cell(cell_id)
            return
        from undertow.cells.elastic.devices import process_device_index
        from undertow.cells.elastic.step import member_main

        inbox = self.context.Queue()
        process = self.context.Process(
            target=member_main, name=member_name(cell_id), daemon=True,
            args=(self.address, member_name(cell_id), self.model_dir, inbox),
            kwargs={"timeout_s": self.timeout_s, **self.member_options,
                    "device_index": process_device_index(self.learner, cell_id)})
        process.start()
        self.running[cell_id] = _RunningMember([process], [inbox])

    def _start_cell(self, cell_id: int) -> _RunningMember:
        """The cell's processes, rank 0 its leader, meeting at a store served here."""
        import datetime

        from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]  # public in torch's docs; re-exported without __all__

        from undertow.cells.elastic.devices import process_device_index
        from undertow.cells.elastic.sharded_cell import cell_main
        from undertow.cells.elastic.step import HOST

        size = self.processes_per_cell
        cell_store = TCPStore(HOST, 0, world_size=size + 1, is_master=True,
                              wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.timeout_s))
        running = _RunningMember([], [], cell_store)
        for rank in range(size):
            inbox = self.context.Queue()
            process = self.context.Process(
                target=cell_main, name=f"{member_name(cell_id)}-{rank}", daemon=True,
                args=(rank, size, (HOST, cell_store.port), self.address,
                      member_name(cell_id), self.model_dir, inbox),
                kwargs={"timeout_s": self.timeout_s, **self.member_options,
                        "device_index": process_device_index(self.learner, cell_id, rank, size)})
            process.start()
            running.processes.append(process)
            running.inboxes.append(inbox)
        return running

    def join(self, cell_id: int, step: int) -> None:
        for inbox in self.running[cell_id].inboxes:
            inbox.put(step)

    def stop(self, cell_id: int) -> None:
        """Waits for the member's processes to finish their step and exit; kills them
        after timeout_s."""
        running = self.running.pop(cell_id)
        for inbox in running.inboxes:
            inbox.put(None)
        deadline = time.monotonic() + self.timeout_s   # one bound for the cell, not each
        for process in running.processes:
            process.join(timeout=max(deadline - time.monotonic(), 0.0))
        stuck = [process for process in running.processes if process.is_alive()]
        for process in stuck:
            process.terminate()
            process.join(timeout=10)
        if stuck:
            raise CellPoolError(f"the member of cell {cell_id} did not exit within "
                                f"{self.timeout_s} s and was terminated")
        failed = [p.exitcode for p in running.processes if p.exitcode != 0]
        if failed:
            raise CellPoolError(f"the member of cell {cell_id} exited with {failed[0]}; "
                                "see its output above")

    def close(self, timeout_s: float = 30.0) -> None:
        """Ends every member without raising: asks, waits up to `timeout_s`, terminates."""
        running, self.running = self.running, {}
        for member in running.values():
            for inbox in member.inboxes:
                inbox.put(None)
        for member in running.values():
            for process in member.processes:
                process.join(timeout=timeout_s)
                if process.is_alive():
                    process.terminate()
                    process.join(timeout=10)


class ThreadMembers:
    """Each cell's member as a thread of this process (same protocol as ProcessMembers)."""

    def __init__(self, address: tuple[str, int], model_dir: str | Path,
                 timeout_s: float = 300.0, **member_options: Any):
        from undertow.cells.elastic.devices import member_learner, with_learner

        self.address, self.model_dir, self.timeout_s = address, str(model_dir), timeout_s
        self.learner = member_learner(member_options)
        self.member_options = with_learner(member_options, self.learner)
        self.running: dict[int, tuple[threading.Thread, queue.Queue]] = {}
        self.errors: dict[int, BaseException] = {}
        # transformers' model loading is not thread-safe (it patches module-level
        # initialisation while it builds a model), so members load one at a time.
        self.loading = threading.Lock()

    def start(self, cell_id: int) -> None:
        inbox: queue.Queue = queue.Queue()
        thread = threading.Thread(target=self._run, args=(cell_id, inbox),
                                  name=member_name(cell_id), daemon=True)
        thread.start()
        self.running[cell_id] = (thread, inbox)

    def join(self, cell_id: int, step: int) -> None:
        self.running[cell_id][1].put(step)

    def stop(self, cell_id: int) -> None:
        thread, inbox = self.running.pop(cell_id)
        inbox.put(None)
        thread.join(timeout=self.timeout_s)
        if thread.is_alive():
            raise CellPoolError(f"the member of cell {cell_id} did not finish within "
                                f"{self.timeout_s} s")
        if cell_id in self.errors:
            failure = self.errors.pop(cell_id)
            raise CellPoolError(f"the member of cell {cell_id} failed") from failure

    def close(self, timeout_s: float = 30.0) -> None:
        """Asks every member to end and waits up to `timeout_s` each (threads cannot be
        killed: a member stuck in a step ends when its store times out)."""
        running, self.running = self.running, {}
        for _thread, inbox in running.values():
            inbox.put(None)
        for thread, _inbox in running.values():
            thread.join(timeout=timeout_s)

    def _run(self, cell_id: int, inbox: queue.Queue) -> None:
        from undertow.cells.elastic.devices import process_device_index
        from undertow.cells.elastic.step import Member

        try:
            with self.loading:
                member = Member(self.address, member_name(cell_id), self.model_dir,
                                timeout_s=self.timeout_s, **self.member_options,
                                device_index=process_device_index(self.learner, cell_id))
            while (step := inbox.get()) is not None:
                member.join(step)
        except BaseException as error:  # reported by stop(), in the pool's thread
            self.errors[cell_id] = error
