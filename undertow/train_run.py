"""`undertow train`: engine(s), gateway, rollouts and the learner of one run, wired.

Threads: the learner (sync, `learner/train.py`) runs in the main thread; the engine,
the gateway (`embedded.py`) and the rollouts (`adapters/rollout.py`) run on an
asyncio loop in one background thread. `rollout_source.ThreadedGroupSource` joins the
two: `launch` schedules a group's rollout on the loop, `wait` reads the finished groups'
trees from the gateway's admin API. The learner pushes weights through the gateway's pool
(`POST /admin/update_weights`).

Sections of the run config: `run` (`RunConfig`, below), `rollout` (`RolloutSection`),
`learner`, `loss`, `advantages` (see `learner/config.py`), `warm_start`
(`warm_start.py`), `sandbox` (`sandboxes/hosts.py`'s HostsConfig: the Docker daemons the
sessions' sandboxes run on, `docker_hosts`, and `max_sessions_per_host`), and optionally
`pool` (`learner/pool/config.py`): with it the run goes to `pool_run.py`, the machine
split into cells that move between rollout and training. With no config file, `undertow
train` reads `configs/learn.yaml`: the tiny model (built once into the run directory), a
warm start, one built-in engine, the embedded gateway and one-call chat sessions on a
prompt task set whose reward the policy visibly learns in minutes. `configs/swe.yaml` is
the SWE run: mini-swe-agent on the bundled tasks in Docker sandboxes.

`rollout.scaffold` is a scaffold of `adapters/registry.py` (sessions in Docker
sandboxes on SWE tasks) or `chat` (one chat call per session on a prompt task set,
rewarded by the function each task names: `adapters/chat_rollout.py`).
`rollout.source` plugs in another rollout (`rollout_source.py`, shared with `pool_run.py`).

Resume: `--resume` continues the latest checkpoint of `run.run_dir`; the engine
restarts and loads the checkpoint's weights as their version before any rollout (in a
pool run every cell's engine does, and the unpublished steps are rebuilt: `pool_run.py`).
Groups that finished before the crash but were not in the checkpoint are read back from
the gateway's store, not run again (`rollout_source.ThreadedGroupSource`).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from undertow.config import build_section, read_config
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
from undertow.warm_start import WarmStartSection

SECTIONS = ("run", "rollout", "learner", "loss", "advantages", "warm_start", "logging",
            "pool", "sandbox")
CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = CONFIGS_DIR / "learn.yaml"


@dataclass(frozen=True)
class RunConfig:
    """Where the run lives and what it serves. `model_dir` None: the tiny model, built
    once into `run_dir/model-base`; `engine_urls` empty: one built-in engine."""

    run_dir: Path = Path("runs/train")
    model_dir: Path | None = None
    engine_urls: tuple[str, ...] = ()
    docker_url: str | None = None


def resolve_config(config_path: Path | None, overrides: list[str], run_dir: Path | None,
                   resume: bool) -> dict[str, Any]:
    """The run config: the file (or, on resume without one, the checkpoint's), overrides."""
    from undertow.learner.checkpoint import latest_checkpoint

    if run_dir is not None:
        overrides = [*overrides, f"run.run_dir={run_dir}"]
    tree = read_config(config_path or DEFAULT_CONFIG, overrides)
    unknown = sorted(set(tree) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown config section(s) {unknown}; known: {list(SECTIONS)}")
    if resume and config_path is None:   # the checkpoint's config, else the default
        run = build_section(RunConfig, tree.get("run"), "run")
        latest = latest_checkpoint(run.run_dir)
        if latest is not None:
            tree = read_config(latest / "config.yaml", overrides)
    return tree


def base_model_dir(run: RunConfig) -> Path:
    if run.model_dir is not None:
        return run.model_dir
    from undertow.learner.modeldir import ensure_model_dir

    return ensure_model_dir(run.run_dir / "model-base")


def _plain(tree: dict[str, Any]) -> dict[str, Any]:
    """The config as YAML-safe data (paths as strings) for the checkpoint."""
    import json

    return json.loads(json.dumps(tree, default=str))


def train(tree: dict[str, Any], resume: bool, stop: threading.Event) -> str:
    """Runs (or resumes) the training run described by `tree`; returns "done"/"stopped"."""
    from undertow.learner.advantages import AdvantageConfig
    from undertow.learner.checkpoint import latest_checkpoint
    from undertow.learner.config import TrainConfig
    from undertow.learner.gateway_link import GatewayLink
    from undertow.learner.losses import LossConfig
    from undertow.learner.trackers import TrackerConfig, track_learner
    from undertow.learner.train import Learner

    run = build_section(RunConfig, tree.get("run"), "run")
    rollout = build_section(RolloutSection, tree.get("rollout"), "rollout")
    config = build_section(TrainConfig, tree.get("learner"), "learner")
    loss = build_section(LossConfig, tree.get("loss"), "loss")
    advantages = build_section(AdvantageConfig, tree.get("advantages"), "advantages")
    warm = build_section(WarmStartSection, tree.get("warm_start"), "warm_start")
    hosts = sandbox_hosts(tree.get("sandbox"))
    if not resume and (run.run_dir / "checkpoints").exists():
        raise ValueError(f"{run.run_dir} already holds checkpoints; pass --resume to continue "
                         "it, or choose another run.run_dir")
    model_dir = start_model_dir(run, rollout, warm)
    resolved = _plain({"run": asdict(run), "rollout": asdict(rollout), "learner": asdict(config),
                       "loss": asdict(loss), "advantages": asdict(advantages),
                       "warm_start": asdict(warm), "sandbox": asdict(hosts)})
    tracking = build_section(TrackerConfig, tree.get("logging"), "logging")
    resolved["logging"] = _plain({"logging": asdict(tracking)})["logging"]
    if "pool" in tree:
        return _train_with_pool(tree["pool"], resume, stop, model_dir, resolved, {
            "run": run, "rollout": rollout, "learner": config, "loss": loss,
            "advantages": advantages, "sandbox": hosts})
    learner = (Learner.restore if resume else Learner)(
        config, loss, advantages, model_dir, run.run_dir, resolved)
    trackers = track_learner(learner, tracking, resolved, model_dir)
    with background_loop() as loop, \
            held_on(loop, embedded_gateway(model_dir, run.run_dir / "store",
                                           run.engine_urls)) as gateway:
        admin = GatewayLink(gateway.url, gateway.admin_token, push_mode=config.push_mode)
        if learner.state.step > 0:
            admin.push(latest_checkpoint(run.run_dir) / "model", learner.state.step)
        print(f"undertow train: gateway {gateway.url}, engines {list(gateway.engine_urls)}, "
              f"run {run.run_dir}, from step {learner.state.step}", flush=True)
        context = RolloutContext(gateway.url, gateway.admin_token, run.run_dir, rollout,
                                 run.docker_url, hosts)
        source = ThreadedGroupSource(loop, load_source(context), admin,
                                     learner.state.num_resumes)
        try:
            outcome = learner.run(source, admin, stop, on_step=step_printer(config.num_steps))
        finally:
            source.cancel()
            trackers.close()
    print(f"undertow train: {outcome} at step {learner.state.step}", flush=True)
    print_results(run.run_dir, rollout)
    return outcome


def sandbox_hosts(section: dict[str, Any] | None):
    """The `sandbox` section: which Docker daemons run the sessions' sandboxes."""
    from undertow.sandboxes.hosts import HostsConfig

    return build_section(HostsConfig, section, "sandbox")


def start_model_dir(run: RunConfig, rollout: RolloutSection, warm: WarmStartSection) -> Path:
    """The weights the run starts from: the base model, warm-started when the rollout
    is `chat` on tasks that list `warm_start` replies (`warm_start.py`)."""
    model_dir = base_model_dir(run)
    if rollout.scaffold != CHAT or rollout.source or warm.num_steps == 0:
        return model_dir
    from undertow.warm_start import warm_start

    return warm_start(select_prompt_tasks(rollout), model_dir, run.run_dir / "model-warm", warm)


def _train_with_pool(section: dict[str, Any] | None, resume: bool, stop: threading.Event,
                     model_dir: Path, resolved: dict[str, Any], sections: dict[str, Any]) -> str:
    """The run (or its resume) on a cell pool (`pool_run.py`); without a `pool` section
    `train` runs as before."""
    from undertow.learner.pool.config import CellPoolConfig
    from undertow.pool_run import train_with_pool

    pool = build_section(CellPoolConfig, section, "pool")
    return train_with_pool(pool, sections, model_dir, {**resolved, "pool": asdict(pool)}, stop,
                           resume)
