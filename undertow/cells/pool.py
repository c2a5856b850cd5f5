"""The pool run's cells on this machine's gateway: `CellPool`, the `Pool` of a run with a
`pool` section, and `GatewayEngineSlots`, the engines of its rollout cells
(docs/cluster.md, "How the cell pool runs"). `serve_cell_pool` starts them for `undertow train`:
the gateway with no engine of its own, one engine per cell, the learner members of
`pool.backend` (`backends.py`) and the policy `pool.policy` names.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from undertow.cells.config import CellPoolConfig
from undertow.cells.protocol import RunParts
from undertow.gateway.engines.launch import LAUNCHERS, Launcher, RunningEngine, sharing_kv
from undertow.run.engine_keeper import KeptEngine

if TYPE_CHECKING:   # the learner's modules import torch: for the annotations only
    from undertow.cells.backends import LocalBackend
    from undertow.cells.elastic.learner import ElasticLearner
    from undertow.cells.elastic.local import CellRoles
    from undertow.cells.policy import Policy
    from undertow.learner.gateway_link import GatewayLink
    from undertow.learner.train import WeightSink
    from undertow.run.sections import RunSections

CellLaunchers = Callable[[int, int], Launcher]


def cell_gpu_ids(cell_id: int, tp_size: int) -> tuple[int, ...]:
    """The GPUs of cell `cell_id` on this node: a block of `tp_size`, cell after cell
    (the block its learner member's processes take, `undertow/cells/elastic/devices.py`)."""
    return tuple(range(cell_id * tp_size, (cell_id + 1) * tp_size))


def cell_launcher(pool: CellPoolConfig, cell_id: int, weight_version: int,
                  gpu_ids: tuple[int, ...] | None = None) -> Launcher:
    """The launcher of cell `cell_id`'s engine on `weight_version`: `pool.engine`'s kind
    (`Launcher.for_cell`). A GPU engine sees `gpu_ids` (default: the cell's block,
    `cell_gpu_ids`)."""
    launcher = LAUNCHERS[pool.engine].for_cell(
        weight_version=str(weight_version), num_threads=pool.threads_per_cell,
        gpu_ids=gpu_ids or cell_gpu_ids(cell_id, pool.tp_size),
        mem_fraction_static=pool.mem_fraction_static, python=pool.sglang_python)
    if pool.sglang_kv_share_dir:  # an SGLang cell (`CellPoolConfig` refuses it otherwise)
        launcher = sharing_kv(launcher, Path(pool.sglang_kv_share_dir))
    return launcher


def check_engine_gpus(pool: CellPoolConfig, num_gpus: int) -> None:
    """Refuses SGLang cells that do not fit in this node's `num_gpus` GPUs (ValueError
    naming the fields), before anything starts."""
    if LAUNCHERS[pool.engine].uses_gpus and pool.num_engine_gpus() > num_gpus:
        raise ValueError(f"pool.num_cells={pool.num_cells} SGLang cells of pool.tp_size="
                         f"{pool.tp_size} GPUs need {pool.num_engine_gpus()} GPUs, but this "
                         f"node has {num_gpus}; lower pool.num_cells or pool.tp_size")


class GatewayEngineSlots:
    """The engines of the rollout cells.

    Invariants: `engines` maps each cell that serves to its running engine process and
    the ID the gateway gave it; a cell absent from it has no engine process and no engine
    at the gateway; `warm` holds engines started ahead of `serve` (not yet at the
    gateway), each with the weight version it loaded; `weights` is the newest (model
    directory, weight version) pushed.
    `launchers(cell_id, weight_version)` gives a cell's engine launcher (default: the
    built-in engine on `threads_per_cell` threads). `warm_start` false: `prepare` starts
    nothing, as for engines on the cell's GPUs, which are its learner member's until the
    member stops in `serve`'s turn (`CellRoles._move_to_rollout`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, admin: GatewayLink, model_dir: Path,
                 log_dir: Path, threads_per_cell: int = 1, push_mode: str = "drain",
                 launchers: CellLaunchers | None = None, warm_start: bool = True,
                 weight_version: int = 0):
        self.loop, self.admin, self.log_dir = loop, admin, Path(log_dir)
        self.threads_per_cell, self.push_mode = threads_per_cell, push_mode
        self.launchers = launchers or self._builtin_launcher
        self.warm_start = warm_start
        self.weights: tuple[Path, int] = (Path(model_dir), weight_version)
        self.engines: dict[int, tuple[RunningEngine | KeptEngine, str]] = {}
        self.warm: dict[int, tuple[RunningEngine | KeptEngine, int]] = {}
        self.num_started = 0

    def start_all(self, cell_ids: list[int]) -> None:
        """Starts every cell's engine at once, then adds each at the gateway."""
        running = self._wait(_gather([self._start(c) for c in cell_ids]))
        failed = [r for r in running if isinstance(r, BaseException)]
        if failed:
            self._wait(_gather([r.stop() for r in running
                                if not isinstance(r, BaseException)]))
            raise failed[0]
        for cell_id, engine in zip(cell_ids, running, strict=True):
            self._register(cell_id, engine)

    def drain(self, cell_id: int) -> None:
        engine, engine_id = self.engines.pop(cell_id)
        try:
            self.admin.remove_engine(engine_id, migrate=True)
        finally:
            self._wait(engine.stop())

    def serve(self, cell_id: int, weight_version: int) -> None:
        if weight_version != self.weights[1]:
            raise ValueError(f"cell {cell_id}: asked to serve weights {weight_version}, but "
                             f"the newest pushed are {self.weights[1]}")
        engine, version = self.warm.pop(cell_id, (None, weight_version))
        if engine is not None and version != weight_version:
            self._wait(engine.stop())
            engine = None
        self._register(cell_id, engine or self._wait(self._start(cell_id)))

    def prepare(self, cell_ids: list[int]) -> None:
        """Starts the engines of cells about to serve all at once (engine start-up is
        seconds of process and model loading); `serve` then only adds them."""
        if not self.warm_start:
            return
        cold = [c for c in cell_ids if c not in self.engines and c not in self.warm]
        version = self.weights[1]
        running = self._wait(_gather([self._start(c) for c in cold]))
        for cell_id, engine in zip(cold, running, strict=True):
            if not isinstance(engine, BaseException):
                self.warm[cell_id] = (engine, version)  # a failed start is retried by `serve`

    def push(self, model_dir: Path, weight_version: int) -> None:
        """Publishes the weights; a cell's engine that dies loading them is waited for
        until it serves again (its `KeptEngine` restarts it) and given them again."""
        self.weights = (Path(model_dir), weight_version)
        self.admin.update_weights(model_dir, weight_version, self.push_mode,
                                  [engine.url for engine, _id in self.engines.values()
                                   if isinstance(engine, KeptEngine)])

    def num_sessions(self) -> dict[int, int]:
        """Sessions pinned to each serving cell's engine at the gateway."""
        pinned = {e["id"]: e["num_pinned_sessions"] for e in self.admin.engines()}
        return {cell_id: pinned.get(engine_id, 0)
                for cell_id, (_engine, engine_id) in self.engines.items()}

    def num_closed(self, group_ids: list[str]) -> dict[str, int]:
        """Closed sessions of each group; a rollout's gateway group is the group ID, or
        the group ID and the task (`adapters.rollout`: `{group_id}.{instance_id}`)."""
        counts = dict.fromkeys(group_ids, 0)
        for session in self.admin.sessions():
            if not session["closed"]:
                continue
            group = session["group"]
            name = group if group in counts else group.rsplit(".", 1)[0]
            if name in counts:
                counts[name] += 1
        return counts

    def cell_of(self, engine_id: str) -> int | None:
        """The cell whose engine has this gateway ID (None when none serves)."""
        return next((c for c, (_e, i) in self.engines.items() if i == engine_id), None)

    def close(self) -> None:
        """Stops every engine still running (the gateway may already be gone)."""
        engines, self.engines, warm, self.warm = self.engines, {}, self.warm, {}
        self._wait(_gather([engine.stop() for engine, _id in engines.values()] +
                           [engine.stop() for engine, _version in warm.values()]))

    async def _start(self, cell_id: int) -> RunningEngine | KeptEngine:
        """The cell's engine, started again on its port should it die (`KeptEngine`)."""
        self.num_started += 1
        model_dir, version = self.weights
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return await KeptEngine.start(self.launchers(cell_id, version), model_dir,
                                      self.log_dir / f"cell-{cell_id}-{self.num_started}.log")

    def _builtin_launcher(self, cell_id: int, weight_version: int) -> Launcher:
        return cell_launcher(CellPoolConfig(threads_per_cell=self.threads_per_cell), cell_id,
                             weight_version)

    def _register(self, cell_id: int, engine: RunningEngine | KeptEngine) -> None:
        try:
            record = self.admin.add_engine(engine.url)
            if record.get("weight_version") != str(self.weights[1]):
                self.push(*self.weights)
        except BaseException:
            self._wait(engine.stop())
            raise
        self.engines[cell_id] = (engine, record["id"])

    def _wait(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


async def _gather(coroutines: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Every coroutine's result or exception, in order."""
    return await asyncio.gather(*coroutines, return_exceptions=True)


class RolloutSide(Protocol):
    """The rollout side of a `CellPool`: session counts and engines started ahead
    (`GatewayEngineSlots`)."""

    def num_sessions(self) -> dict[int, int]: ...

    def num_closed(self, group_ids: list[str]) -> dict[str, int]: ...

    def prepare(self, cell_ids: list[int]) -> None: ...


class CellPool:
    """The `Pool` of a run with a `pool` section: `roles` moves the cells between rollout
    and training as `policy` decides, `rollout` counts their sessions and starts engines
    ahead, and new weights go to `sink` (in `undertow train` both are the
    `GatewayEngineSlots`)."""

    def __init__(self, roles: CellRoles, policy: Policy, rollout: RolloutSide, sink: WeightSink):
        self.roles, self.policy, self.rollout, self.sink = roles, policy, rollout, sink

    def num_sessions(self) -> dict[int, int]:
        return self.rollout.num_sessions()

    def num_closed(self, group_ids: list[str]) -> dict[str, int]:
        return self.rollout.num_closed(group_ids)

    def prepare(self, cell_ids: list[int]) -> None:
        self.rollout.prepare(cell_ids)

    def push(self, model_dir: Path, weight_version: int) -> None:
        self.sink.push(model_dir, weight_version)


class ResidentMembers:
    """`MemberSlots` whose member processes outlive their cell's training turns.

    `ProcessMembers` ends a member when its cell returns to rollout, so every move to
    training pays a process start and a model load (about 10 s on a busy 2-core machine).
    Here a cell's member is started on its first move and stays, idle and holding its
    model in memory, while the cell serves; `stop` only lets it be. That is safe because
    a member works through the steps it is sent in order and one it is sent too late for
    is refused at once (`Member.join` returns False when the roster has closed).
    """

    def __init__(self, members: Any):
        self.members = members

    def start(self, cell_id: int) -> None:
        if cell_id not in self.members.running:
            self.members.start(cell_id)

    def join(self, cell_id: int, step: int) -> None:
        self.members.join(cell_id, step)

    def stop(self, cell_id: int) -> None:
        return None

    def close(self) -> None:
        self.members.close()


@contextlib.contextmanager
def engineless_gateway(loop: asyncio.AbstractEventLoop, model_dir: Path,
                       store_dir: Path, host: str = "127.0.0.1") -> Iterator[Any]:
    """The gateway, started on `loop` with no engine (the cells add theirs), bound to
    `host`."""
    from undertow.run.embedded import held_on, serve_gateway

    with held_on(loop, serve_gateway(model_dir, store_dir, (), host=host)) as gateway:
        yield gateway


@contextlib.contextmanager
def serve_cell_pool(loop: asyncio.AbstractEventLoop, sections: RunSections,
                    learner: ElasticLearner, model_dir: Path, weights: tuple[Path, int], *,
                    backend: LocalBackend) -> Iterator[RunParts]:
    """The pool run's parts on `loop`: the learner members of `backend` on the base model
    `model_dir` (reaching the learner's coordinator), the gateway with no engine, every
    cell's engine serving `weights`, and the `CellPool`. On leaving, stops the engines,
    the members and the learner's coordinator."""
    from undertow.cells import Cell, make_policy
    from undertow.cells.elastic.local import CellRoles
    from undertow.learner.gateway_link import GatewayLink

    run, config, pool = sections.run, sections.learner, sections.pool
    if pool is None:
        raise ValueError("serve_cell_pool needs a run config with a `pool` section; "
                         "run it without one through `one_cell.serve_one_cell`")
    members = _members(sections, backend, learner, model_dir)
    try:
        with engineless_gateway(loop, model_dir, run.run_dir / "store",
                                backend.gateway_host) as gateway:
            admin = GatewayLink(gateway.url, gateway.admin_token, push_mode=config.push_mode)
            # First: the Ray backend's engine slots check that their nodes reach this URL.
            url = backend.advertised_url(gateway.url)
            slots = backend.engine_slots(loop, admin, weights[0], run.run_dir / "engines",
                                         pool.threads_per_cell, config.push_mode,
                                         weight_version=weights[1])
            try:
                cells = [Cell(i, num_session_slots=pool.num_session_slots)
                         for i in range(pool.num_cells)]
                slots.start_all([cell.cell_id for cell in cells])
                roles = CellRoles(cells, slots, members, weight_version=weights[1])
                yield RunParts(url, admin, CellPool(roles, make_policy(pool.policy_spec()),
                                                    slots, slots),
                               f"{pool.num_cells} cells ({pool.policy}, {pool.backend})")
            finally:
                slots.close()
    finally:
        members.close()
        learner.close()


def _members(sections: RunSections, backend: LocalBackend, learner: ElasticLearner,
             model_dir: Path) -> Any:
    """The learner members of `backend`, reaching the learner's coordinator (kept
    between training turns with `pool.resident_members`)."""
    pool, loss = sections.pool, sections.loss
    assert pool is not None
    members = backend.members(
        learner.coordinator.address, model_dir, timeout_s=pool.timeout_s,
        num_threads=pool.threads_per_cell, learner=sections.learner,
        reference_dir=str(model_dir) if loss.kl_coef else None)
    return ResidentMembers(members) if pool.resident_members else members
