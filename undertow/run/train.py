"""`undertow train`: engine(s), gateway, rollouts and the learner of one run, wired.

`train` picks the pool the one loop (`undertow/cells/loop.py`) drives: without a `pool`
section `OneCell` and the plain `Learner`, with one `CellPool` and the `ElasticLearner`;
`_train` runs the loop the same way on both. The learner and the loop run in the main
thread, the gateway, engines and rollouts on an asyncio loop in a background thread
(`rollout_source.ThreadedGroupSource` joins the two). The flow, the configs and resume:
docs/design.md ("From `undertow train` to the loss") and docs/training.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from undertow.cells.one_cell import serve_one_cell
from undertow.cells.protocol import RunParts
from undertow.run.report import print_results, step_printer
from undertow.run.rollout_source import (
    CHAT,
    CHAT_SCAFFOLDS,
    RolloutContext,
    ThreadedGroupSource,
    background_loop,
    load_source,
    select_prompt_tasks,
)
from undertow.run.sections import RunConfig, RunSections
from undertow.run.warm_start import warm_start

if TYPE_CHECKING:   # the learner's modules import torch: for the annotations only
    from undertow.adapters.chat_rollout import PromptTask
    from undertow.learner.train import Learner

# Starts a pool for a learner: (loop, sections, learner, base model, served weights).
ServePool = Callable[[asyncio.AbstractEventLoop, "RunSections", Any, Path, tuple[Path, int]],
                     contextlib.AbstractContextManager[RunParts]]


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

    run, rollout = sections.run, sections.rollout
    if not resume and list_checkpoints(run.run_dir):
        raise ValueError(f"{run.run_dir} already holds checkpoints; pass --resume to continue "
                         "it, or choose another run.run_dir")
    model_dir = base_model_dir(run)
    # A chat run's tasks, selected once: the warm start imitates them, the rollouts run them.
    prompt_tasks = select_prompt_tasks(rollout) if rollout.scaffold in CHAT_SCAFFOLDS else None
    if prompt_tasks and rollout.scaffold == CHAT and not rollout.source and \
            sections.warm_start.num_steps:
        model_dir = warm_start(prompt_tasks, model_dir, run.run_dir / "model-warm",
                               sections.warm_start)
    if sections.pool is None:
        from undertow.learner.train import Learner

        learner = _learner(Learner, sections, model_dir, resume)
        return _train(sections, learner, model_dir, prompt_tasks, stop, serve_one_cell)
    if run.engine_urls:
        raise ValueError("run.engine_urls is set, but a pool run starts its cells' own "
                         "engines; remove one of them")
    from undertow.cells.backends import pool_backend
    from undertow.cells.elastic.learner import ElasticLearner
    from undertow.cells.pool import serve_cell_pool

    with pool_backend(sections.pool, run.run_dir, sections.learner) as backend:
        learner = _learner(ElasticLearner, sections, model_dir, resume,
                           timeout_s=sections.pool.timeout_s)
        return _train(sections, learner, model_dir, prompt_tasks, stop,
                      functools.partial(serve_cell_pool, backend=backend))


def _learner(learner_class: type[Learner], sections: RunSections, model_dir: Path,
             resume: bool, **options: Any) -> Learner:
    """A new learner of `learner_class`, or with `resume` the one of the latest checkpoint;
    its start recorded (`Learner.begin_run`)."""
    make = learner_class.restore if resume else learner_class
    learner = make(sections.learner, sections.loss, sections.advantages, model_dir,
                   sections.run.run_dir, sections.resolved, **options)
    learner.begin_run()
    return learner


def _train(sections: RunSections, learner: Learner, model_dir: Path,
           prompt_tasks: Sequence[PromptTask] | None, stop: threading.Event,
           serve_pool: ServePool) -> str:
    """The run of `learner` on the pool `serve_pool` starts: the gateway and engines, the
    rollouts (a chat run's on `prompt_tasks`), and the one loop."""
    from undertow.cells.loop import RunLoop
    from undertow.learner.trackers import TrackedMetricsLog, open_trackers, truncate_steps

    run, config, resolved = sections.run, sections.learner, learner.resolved_config
    weights = (model_dir, 0)
    if learner.restored_from is not None:   # the engines serve its weights from the start
        weights = (learner.restored_from / "model", learner.state.step)
    truncate_steps(run.run_dir, learner.state.step)
    trackers = open_trackers(sections.logging, run.run_dir, resolved,
                             lambda: learner.state.consumed, model_dir=model_dir)
    try:
        with background_loop() as loop, \
                serve_pool(loop, sections, learner, model_dir, weights) as parts:
            print(f"undertow train: gateway {parts.url}, {parts.description}, run "
                  f"{run.run_dir}, from step {learner.state.step}", flush=True)
            context = RolloutContext(parts.url, parts.admin.token, run.run_dir,
                                     sections.rollout, run.docker_url, sections.sandbox,
                                     prompt_tasks)
            source = ThreadedGroupSource(loop, load_source(context), parts.admin,
                                         learner.state.num_resumes)
            try:
                outcome = RunLoop(learner, parts.pool, source, stop,
                                  on_step=step_printer(config.num_steps),
                                  metrics=TrackedMetricsLog(run.run_dir, trackers)).run()
            finally:
                source.cancel()
    finally:
        trackers.close()
    print(f"undertow train: {outcome} at step {learner.state.step}", flush=True)
    print_results(run.run_dir, sections.rollout)
    return outcome
