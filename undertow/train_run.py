"""`undertow train`: engine(s), gateway, rollouts and the learner of one run, wired.

Every run is a pool of cells driven by the one loop (`learner/loop.py`). Without a `pool`
section the pool is one rollout cell that never moves (`OneCell`): one built-in engine (or
`run.engine_urls`) behind the embedded gateway, and the plain `Learner` training in this
process. With one, the machine is `pool.num_cells` cells that move between rollout and
training (`cells.CellPool`: an engine per rollout cell, a learner member per training cell,
the `ElasticLearner` summing their gradients). `train` builds the one or the other and
`_train` runs the loop the same way for both.

Threads: the learner and the loop run in the main thread; the gateway (`embedded.py`), the
engines' start and stop, and the rollouts (`adapters/rollout.py`) run on an asyncio loop in
one background thread. `rollout_source.ThreadedGroupSource` joins the two: `launch`
schedules a group's rollout on the loop, `wait` reads the finished groups' trees from the
gateway's admin API. Weights reach the engines through the gateway
(`POST /admin/update_weights`).

The run config is read once and built into `run_sections.RunSections` (`run`, `rollout`,
`learner`, `loss`, `advantages`, `warm_start`, `logging`, `sandbox`, and optionally
`pool`); each part gets its own section from it. With no config file, `undertow train`
reads `configs/learn.yaml`: the tiny model (built once into the run directory), a warm
start, one built-in engine, the embedded gateway and one-call chat sessions on a prompt
task set whose reward the policy visibly learns in minutes. `configs/swe.yaml` is the SWE
run: mini-swe-agent on the bundled tasks in Docker sandboxes. A pretrained model is
`run.model_dir` (`configs/learn-smollm2.yaml`: SmolLM2 from `make setup-models`, no warm
start): the learner trains it and the engine serves it from that directory.

`rollout.scaffold` is a scaffold of `adapters/registry.py` (sessions in Docker sandboxes on
SWE tasks) or `chat` (one chat call per session on a prompt task set, rewarded by the
function each task names: `adapters/chat_rollout.py`). `rollout.source` plugs in another
rollout (`rollout_source.py`).

Resume: `--resume` continues the latest whole checkpoint of `run.run_dir`, from whatever a
crash left (`Learner.restore`, `Learner.begin_run`); the engines serve the checkpoint's
weights as their version before any rollout, and the loop rebuilds the unpublished steps.
Groups that finished before the crash but were not in the checkpoint are read back from the
gateway's store, not run again (`rollout_source.ThreadedGroupSource`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from undertow.cells import CellPool, RunCells, RunParts
from undertow.embedded import embedded_gateway, held_on
from undertow.rollout_source import (
    CHAT,
    RolloutContext,
    RolloutSection,
    ThreadedGroupSource,
    background_loop,
    load_source,
    select_prompt_tasks,
)
from undertow.run_report import print_results, step_printer
from undertow.run_sections import RunConfig, RunSections
from undertow.warm_start import WarmStartSection

if TYPE_CHECKING:   # the learner's modules import torch: for the annotations only
    from undertow.learner.train import Learner


def base_model_dir(run: RunConfig) -> Path:
    """`run.model_dir` (a pretrained model directory, e.g. `configs/learn-smollm2.yaml`'s),
    or the tiny model built once into the run directory when it is not set."""
    if run.model_dir is not None:
        if not (run.model_dir / "config.json").is_file():
            raise ValueError(f"run.model_dir {run.model_dir} holds no model (no config.json); "
                             "fetch one there with `undertow model fetch NAME --out "
                             f"{run.model_dir}` (`make setup-models` fills .cache/models), or "
                             "set run.model_dir to a Hugging Face model directory")
        return run.model_dir
    from undertow.learner.modeldir import ensure_model_dir

    return ensure_model_dir(run.run_dir / "model-base")


def train(sections: RunSections, resume: bool, stop: threading.Event) -> str:
    """Runs (or resumes) the training run of `sections`; returns "done"/"stopped"."""
    from undertow.learner.checkpoint import list_checkpoints

    run = sections.run
    if not resume and list_checkpoints(run.run_dir):
        raise ValueError(f"{run.run_dir} already holds checkpoints; pass --resume to continue "
                         "it, or choose another run.run_dir")
    model_dir = start_model_dir(run, sections.rollout, sections.warm_start)
    if sections.pool is None:
        return _train(sections, model_dir, resume, stop, OneCell(sections))
    if run.engine_urls:
        raise ValueError("run.engine_urls is set, but a pool run starts its cells' own "
                         "engines; remove one of them")
    from undertow.pool_backends import pool_backend

    with pool_backend(sections.pool, run.run_dir, sections.learner) as backend:
        return _train(sections, model_dir, resume, stop, CellPool(sections, backend))


def _train(sections: RunSections, model_dir: Path, resume: bool, stop: threading.Event,
           cells: RunCells) -> str:
    """The run on `cells` (`OneCell` or `cells.CellPool`): the learner, the gateway and
    engines, the rollouts, and the one loop."""
    from undertow.learner.loop import RunLoop
    from undertow.learner.trackers import track_learner

    run, config, resolved = sections.run, sections.learner, sections.resolved()
    learner = (cells.learner_class.restore if resume else cells.learner_class)(
        config, sections.loss, sections.advantages, model_dir, run.run_dir, resolved)
    learner.begin_run()
    weights = (model_dir, 0)
    if learner.restored_from is not None:   # the engines serve its weights from the start
        weights = (learner.restored_from / "model", learner.state.step)
    trackers = track_learner(learner, sections.logging, resolved, model_dir)
    try:
        with background_loop() as loop, cells.serve(loop, learner, model_dir, weights) as side:
            print(f"undertow train: gateway {side.url}, {side.description}, run "
                  f"{run.run_dir}, from step {learner.state.step}", flush=True)
            context = RolloutContext(side.url, side.admin.token, run.run_dir,
                                     sections.rollout, run.docker_url, sections.sandbox)
            source = ThreadedGroupSource(loop, load_source(context), side.admin,
                                         learner.state.num_resumes)
            try:
                outcome = RunLoop(learner, side.pool, side.policy, source, side.sink,
                                  side.sessions, stop, on_step=step_printer(config.num_steps)
                                  ).run()
            finally:
                source.cancel()
    finally:
        cells.close()
        trackers.close()
    print(f"undertow train: {outcome} at step {learner.state.step}", flush=True)
    print_results(run.run_dir, sections.rollout)
    return outcome


class OneCell:
    """The run without a `pool` section: one rollout cell that never moves, one built-in
    engine (or `run.engine_urls`) behind the embedded gateway, and the plain `Learner`."""

    def __init__(self, sections: RunSections):
        from undertow.learner.train import Learner

        self.sections, self.learner_class = sections, Learner

    @contextlib.contextmanager
    def serve(self, loop: asyncio.AbstractEventLoop, learner: Learner, model_dir: Path,
              weights: tuple[Path, int]) -> Iterator[RunParts]:
        from undertow.learner.gateway_link import GatewayLink
        from undertow.learner.loop import OneEngine, one_cell

        run, config = self.sections.run, self.sections.learner
        with held_on(loop, embedded_gateway(model_dir, run.run_dir / "store",
                                            run.engine_urls)) as gateway:
            admin = GatewayLink(gateway.url, gateway.admin_token, push_mode=config.push_mode,
                                launched_urls=gateway.launched_urls)
            if weights[1] > 0:
                admin.push(*weights)
            pool, policy = one_cell(learner)
            yield RunParts(gateway.url, admin, admin, OneEngine(), pool, policy,
                           f"engines {list(gateway.engine_urls)}")

    def close(self) -> None:
        return None


def start_model_dir(run: RunConfig, rollout: RolloutSection, warm: WarmStartSection) -> Path:
    """The weights the run starts from: the base model, warm-started when the rollout
    is `chat` on tasks that list `warm_start` replies (`warm_start.py`)."""
    model_dir = base_model_dir(run)
    if rollout.scaffold != CHAT or rollout.source or warm.num_steps == 0:
        return model_dir
    from undertow.warm_start import warm_start

    return warm_start(select_prompt_tasks(rollout), model_dir, run.run_dir / "model-warm", warm)
