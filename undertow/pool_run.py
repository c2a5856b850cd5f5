"""`undertow train` with a `pool` section: this machine as cells that move between roles.

Started by `train_run.train` when the run config has a `pool` section
(`learner/pool/config.py`). The pieces, wired here:

- the gateway, in this process, with no engine of its own;
- `cells.GatewayEngineSlots`: one built-in engine process per rollout cell, added at the
  gateway, drained with migration and stopped when its cell moves to training, started on
  the newest weights when it comes back;
- `elastic.step.Coordinator` in the learner's process and one learner member process per
  training cell (`elastic.local.ProcessMembers`, gloo on CPUs; Ray actors on their cells' nodes
  with `pool.backend: ray`, `pool_backends.py`), so the step's gradient is computed by
  whichever cells are training;
- `elastic.local.LocalPool` carrying out the policy's decisions, and `elastic.loop.PoolLoop`
  driving it: rollout groups are launched when the policy dispatches a batch, and a step streams
  its groups to the training cells as they finish.

Resume (`undertow train --resume`): the learner is restored from the latest checkpoint
(weights, optimizer, the groups of unpublished steps that had finished), every cell's
engine starts on the checkpoint's weights as their version, and the loop rebuilds the
unpublished steps (`elastic.loop.PoolLoop`), launching again the groups that were running; a
group that had finished before the crash (all its sessions closed in the gateway's
store, which the new gateway replays) is read back from the store instead of run again
(`rollout_source.ThreadedGroupSource`).

Threads as in `train_run`: the learner, the pool and its members' queues in the main
thread; the gateway, engine start/stop and the rollouts on the asyncio loop in a
background thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from undertow.learner.pool.config import CellPoolConfig
from undertow.rollout_source import (
    RolloutContext,
    ThreadedGroupSource,
    background_loop,
    load_source,
)
from undertow.run_report import print_results, step_printer
from undertow.run_sections import RunSections


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
    from undertow.embedded import held_on, serve_gateway

    with held_on(loop, serve_gateway(model_dir, store_dir, (), host=host)) as gateway:
        yield gateway


def train_with_pool(sections: RunSections, model_dir: Path, stop, resume: bool = False) -> str:
    """Runs (or, with `resume`, continues from the latest checkpoint) the training run
    of `sections` (whose `pool` is set) on `pool.num_cells` cells, on the backend
    `pool.backend` names (`pool_backends.py`); returns "done" or "stopped"."""
    from undertow.pool_backends import pool_backend

    if sections.pool is None:
        raise ValueError("a pool run needs the config's pool section")
    with pool_backend(sections.pool, sections.run.run_dir, sections.learner) as backend:
        return _train_on(backend, sections, model_dir, stop, resume)


def _train_on(backend, sections: RunSections, model_dir: Path, stop, resume: bool) -> str:
    from undertow.learner.checkpoint import latest_checkpoint
    from undertow.learner.elastic.loop import ElasticLearner
    from undertow.learner.elastic.step import Coordinator
    from undertow.learner.pool import Cell, make_policy
    from undertow.learner.trackers import track_learner

    run, config, loss, pool = sections.run, sections.learner, sections.loss, sections.pool
    resolved = sections.resolved()
    if run.engine_urls:
        raise ValueError("run.engine_urls is set, but a pool run starts its cells' own "
                         "engines; remove one of them")
    learner = (ElasticLearner.restore if resume else ElasticLearner)(
        config, loss, sections.advantages, model_dir, run.run_dir, resolved)
    weights = (model_dir, 0)
    if learner.state.step > 0:   # the engines serve the checkpoint's weights from the start
        weights = (latest_checkpoint(run.run_dir) / "model", learner.state.step)
    learner.coordinator = Coordinator(learner.policy, run.run_dir / "elastic",
                                      timeout_s=pool.timeout_s)
    members = backend.members(learner.coordinator.address, model_dir, timeout_s=pool.timeout_s,
                              num_threads=pool.threads_per_cell, learner=config,
                              reference_dir=str(model_dir) if loss.kl_coef else None)
    if pool.resident_members:
        members = ResidentMembers(members)
    cells = [Cell(i, num_session_slots=pool.num_session_slots) for i in range(pool.num_cells)]
    trackers = track_learner(learner, sections.logging, resolved, model_dir)
    try:
        outcome = _run_cells(pool, sections, weights, learner, members, cells,
                             make_policy(pool.policy_spec()), stop, backend)
        print(f"undertow train: {outcome} at step {learner.state.step}", flush=True)
    finally:
        members.close()
        learner.coordinator.close()
        trackers.close()
    print_results(run.run_dir, sections.rollout)
    return outcome


def _run_cells(pool: CellPoolConfig, sections: RunSections, weights: tuple[Path, int],
               learner, members, cells, policy, stop, backend) -> str:
    from undertow.learner.elastic.local import LocalPool
    from undertow.learner.elastic.loop import PoolLoop
    from undertow.learner.gateway_link import GatewayLink

    run, config = sections.run, sections.learner
    model_dir, weight_version = weights
    with background_loop() as loop, \
            engineless_gateway(loop, model_dir, run.run_dir / "store",
                               backend.gateway_host) as gateway:
        admin = GatewayLink(gateway.url, gateway.admin_token, push_mode=config.push_mode)
        gateway_url = backend.advertised_url(gateway.url)
        slots = backend.engine_slots(loop, admin, model_dir, run.run_dir / "engines",
                                     pool.threads_per_cell, config.push_mode)
        slots.weights = (model_dir, weight_version)
        try:
            slots.start_all([cell.cell_id for cell in cells])
            print(f"undertow train: gateway {gateway_url}, {pool.num_cells} cells "
                  f"({pool.policy}, {pool.backend}), run {run.run_dir}, from step "
                  f"{weight_version}", flush=True)
            context = RolloutContext(gateway_url, gateway.admin_token, run.run_dir,
                                     sections.rollout, run.docker_url, sections.sandbox)
            source = ThreadedGroupSource(loop, load_source(context), admin,
                                         learner.state.num_resumes)
            cell_pool = LocalPool(cells, slots, members, weight_version=weight_version)
            try:
                return PoolLoop(learner, cell_pool, policy, source, slots, slots, stop,
                                on_step=step_printer(config.num_steps)).run()
            finally:
                source.cancel()
        finally:
            slots.close()
