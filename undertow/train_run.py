"""`undertow train`: engine(s), gateway, rollouts and the learner of one run, wired.

Threads: the learner (sync, `learner/train.py`) runs in the main thread; the engine,
the gateway (`embedded.py`) and the rollouts (`adapters/rollout.py`) run on an
asyncio loop in one background thread. `ThreadedGroupSource` joins the two: `launch`
schedules a group's rollout on the loop, `wait` reads the finished groups' trees from
the gateway's admin API. The learner pushes weights through the gateway's pool
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
`rollout.source` plugs in another rollout: `"module:factory"`, where
`factory(context: RolloutContext)` returns `async run_group(request)` giving the group
at the gateway whose sessions it ran and closed with rewards: its name, or a
`GroupOutcome` that also counts the sessions Undertow failed (and re-ran).

Resume: `--resume` continues the latest checkpoint of `run.run_dir`; the engine
restarts and loads the checkpoint's weights as their version before any rollout (in a
pool run every cell's engine does, and the unpublished steps are rebuilt: `pool_run.py`).
Groups that finished before the crash but were not in the checkpoint are read back from
the gateway's store, not run again (`ThreadedGroupSource`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import queue
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from undertow.config import build_section, read_config
from undertow.warm_start import WarmStartSection

SECTIONS = ("run", "rollout", "learner", "loss", "advantages", "warm_start", "logging",
            "pool", "sandbox")
CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = CONFIGS_DIR / "learn.yaml"
CHAT = "chat"
DEFAULT_PROMPT_TASKS = "directions.yaml"   # in undertow.adapters.configs


@dataclass(frozen=True)
class RunConfig:
    """Where the run lives and what it serves. `model_dir` None: the tiny model, built
    once into `run_dir/model-base`; `engine_urls` empty: one built-in engine."""

    run_dir: Path = Path("runs/train")
    model_dir: Path | None = None
    engine_urls: tuple[str, ...] = ()
    docker_url: str | None = None


@dataclass(frozen=True)
class RolloutSection:
    """The rollouts of each group: `scaffold` on the tasks of `tasks` (default: the
    bundled set; for `chat`, `adapters/configs/directions.yaml`), group index i running
    task i mod the number of tasks. A session that Undertow fails is run again as a
    new session of its group, up to `max_attempts` attempts per slot."""

    tasks: Path | None = None
    num_tasks: int | None = None
    instance_ids: tuple[str, ...] = ()
    scaffold: str = "mini-swe-agent"
    scaffold_options: dict = field(default_factory=dict)
    concurrency: int = 2
    timeout_s: float = 600.0
    timeout_value: str = "partial_credit"
    source: str = ""
    max_attempts: int = 3


@dataclass(frozen=True)
class GroupOutcome:
    """What a rollout source's `run_group` may return instead of the group's name:
    `num_opened` sessions opened at the gateway (0: the group has no tree there),
    `failures` by cause and `num_reruns` of the sessions Undertow failed, and one
    failure's `error` message."""

    group: str
    num_opened: int
    failures: dict[str, int] = field(default_factory=dict)
    num_reruns: int = 0
    error: str = ""


@dataclass(frozen=True)
class RolloutContext:
    """What a rollout source is given: the gateway, the tasks, where to write."""

    gateway_url: str
    admin_token: str
    run_dir: Path
    rollout: RolloutSection
    docker_url: str | None
    hosts: Any = None   # sandboxes.hosts.HostsConfig; None: the one daemon of docker_url


RunGroup = Callable[[Any], Awaitable[str]]


class ThreadedGroupSource:
    """`GroupSource` over an asyncio loop in another thread (see the module docstring).

    After a resume (`num_resumes` > 0), a launch first looks in the gateway's store
    (replayed by the new gateway) for the same launch index run before the crash: a
    group there whose sessions are all closed, with at least `group_size` valid ones,
    is finished already and is read back instead of being run again."""

    def __init__(self, loop: asyncio.AbstractEventLoop, run_group: RunGroup, admin,
                 num_resumes: int = 0):
        self.loop, self.run_group, self.admin = loop, run_group, admin
        self.num_resumes = num_resumes
        self.done: queue.Queue = queue.Queue()
        self.futures: set[concurrent.futures.Future] = set()
        self.num_recovered = 0

    def launch(self, request) -> None:
        started_s = time.perf_counter()
        recovered = self._recovered(request)
        if recovered is not None:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(recovered)
            self.num_recovered += 1
            print(f"undertow train: group {recovered} (launch {request.index}) finished "
                  "before the restart; read back from the gateway's store", flush=True)
            self.done.put((request, future, 0.0))
            return
        future = asyncio.run_coroutine_threadsafe(self.run_group(request), self.loop)
        self.futures.add(future)
        future.add_done_callback(
            lambda f: self.done.put((request, f, time.perf_counter() - started_s)))

    def wait(self, timeout_s: float) -> list:
        from undertow.learner.train import FinishedGroup

        finished = []
        with contextlib.suppress(queue.Empty):
            finished.append(self.done.get(timeout=timeout_s))
            while True:
                finished.append(self.done.get_nowait())
        groups = []
        for request, future, rollout_s in finished:
            self.futures.discard(future)
            outcome = future.result()  # a failed rollout stops the run with its error
            if isinstance(outcome, str):
                groups.append(FinishedGroup(request.index, self.admin.group_tree(outcome),
                                            rollout_s))
                continue
            groups.append(FinishedGroup(
                request.index, self._tree(outcome), rollout_s, dict(outcome.failures),
                outcome.num_reruns, outcome.error))
        return groups

    def _recovered(self, request) -> str | None:
        """The name of a finished group of launch `request.index` from before the latest
        resume, if the store holds one."""
        from undertow.learner.advantages import is_infra_failure
        from undertow.learner.train import group_id_of

        for num_resumes in range(self.num_resumes - 1, -1, -1):
            group = group_id_of(request.index, num_resumes)
            sessions = self.admin.sessions(group)
            valid = [s for s in sessions if s["closed"] and not is_infra_failure(s["meta"])]
            if sessions and all(s["closed"] for s in sessions) and \
                    len(valid) >= request.group_size:
                return group
        return None

    def _tree(self, outcome: GroupOutcome):
        from undertow.gateway.tree import Tree

        return self.admin.group_tree(outcome.group) if outcome.num_opened else \
            Tree(outcome.group)

    def cancel(self) -> None:
        for future in list(self.futures):
            future.cancel()
        for future in list(self.futures):
            with contextlib.suppress(BaseException):
                future.result(timeout=120)


def outcome_of(group: str, results) -> GroupOutcome:
    """The `GroupOutcome` of a group's `SessionResult`s (every attempt of every slot)."""
    failed = [r for r in results if r.infra_failure]
    return GroupOutcome(group, sum(bool(r.session_id) for r in results),
                        dict(Counter(r.cause for r in failed)),
                        sum(r.attempt > 0 for r in results),
                        next((r.error for r in failed if r.error), ""))


def chat_rollouts(context: RolloutContext) -> RunGroup:
    """`rollout.scaffold: chat`: one-call chat sessions on a prompt task set."""
    from undertow.adapters.chat_rollout import ChatRollout, ChatRolloutConfig
    from undertow.adapters.gateway_client import GatewayAdmin

    section = context.rollout
    tasks = select_prompt_tasks(section)

    async def run_group(request) -> GroupOutcome:
        config = ChatRolloutConfig(group_size=request.group_size,
                                   concurrency=section.concurrency,
                                   timeout_s=section.timeout_s, max_attempts=section.max_attempts,
                                   **section.scaffold_options)
        task = tasks[request.index % len(tasks)]
        async with GatewayAdmin(context.gateway_url, context.admin_token) as admin:
            results = await ChatRollout(admin, config).run_group(
                task, request.group_id, {"run_group": request.index})
        return outcome_of(request.group_id, results)
    return run_group


def select_prompt_tasks(section: RolloutSection) -> list:
    """The prompt tasks of `rollout.tasks` (default: the directions task set), filtered."""
    from undertow.adapters import configs
    from undertow.adapters.chat_rollout import load_prompt_tasks

    tasks = load_prompt_tasks(section.tasks or Path(configs.__file__).parent /
                              DEFAULT_PROMPT_TASKS)
    if section.instance_ids:
        tasks = [t for t in tasks if t.instance_id in section.instance_ids]
    tasks = tasks[:section.num_tasks] if section.num_tasks else tasks
    if not tasks:
        raise ValueError("rollout: no task selected; check rollout.tasks and instance_ids")
    return tasks


def scaffold_rollouts(context: RolloutContext) -> RunGroup:
    """The SWE source: `adapters.rollout.Rollout` of one task per group."""
    from undertow.adapters.gateway_client import GatewayAdmin
    from undertow.adapters.registry import create_scaffold
    from undertow.adapters.rollout import Rollout, RolloutConfig
    from undertow.sandboxes.hosts import DockerHosts, HostsConfig
    from undertow.sandboxes.task import load_tasks
    from undertow.sandboxes.taskset import BUNDLED_DIR

    section = context.rollout
    tasks = load_tasks(section.tasks or BUNDLED_DIR / "tasks.jsonl")
    if section.instance_ids:
        tasks = [t for t in tasks if t.instance_id in section.instance_ids]
    tasks = tasks[:section.num_tasks] if section.num_tasks else tasks
    if not tasks:
        raise ValueError("rollout: no task selected; check rollout.tasks and instance_ids")
    scaffold = create_scaffold(section.scaffold, section.scaffold_options)
    # One placement for every group, so per-host limits and images hold across groups.
    hosts = DockerHosts.connect(context.hosts or HostsConfig(), context.docker_url)

    async def run_group(request) -> GroupOutcome:
        config = RolloutConfig(group_size=request.group_size, concurrency=section.concurrency,
                               timeout_s=section.timeout_s, out_dir=context.run_dir / "rollouts",
                               run_id=request.group_id, timeout_value=section.timeout_value,
                               progress_interval_s=0, max_attempts=section.max_attempts)
        task = tasks[request.index % len(tasks)]
        async with GatewayAdmin(context.gateway_url, context.admin_token) as admin:
            rollout = Rollout([task], scaffold, admin, hosts, config)
            summary = await rollout.run()
            return outcome_of(rollout.group_name(task), summary.sessions)
    return run_group


def load_source(context: RolloutContext) -> RunGroup:
    if not context.rollout.source and context.rollout.scaffold == CHAT:
        return chat_rollouts(context)
    if not context.rollout.source:
        return scaffold_rollouts(context)
    module_name, sep, attribute = context.rollout.source.partition(":")
    if not sep:
        raise ValueError(f"rollout.source {context.rollout.source!r} must be 'module:factory'")
    return getattr(importlib.import_module(module_name), attribute)(context)


@contextlib.contextmanager
def background_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An asyncio loop running in a daemon thread until the block ends."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="undertow-rollouts", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


@contextlib.contextmanager
def embedded_services(loop, model_dir: Path, store_dir: Path, engine_urls) -> Iterator[Any]:
    """Engine (unless given) and gateway, started on `loop`; stopped on exit."""
    from undertow.embedded import embedded_gateway

    manager = embedded_gateway(model_dir, store_dir, tuple(engine_urls))
    gateway = asyncio.run_coroutine_threadsafe(manager.__aenter__(), loop).result()
    try:
        yield gateway
    finally:
        asyncio.run_coroutine_threadsafe(manager.__aexit__(None, None, None), loop).result()


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
    from undertow.learner.gateway_link import GatewayAdmin
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
            embedded_services(loop, model_dir, run.run_dir / "store", run.engine_urls) as gateway:
        admin = GatewayAdmin(gateway.url, gateway.admin_token, push_mode=config.push_mode)
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


def step_printer(num_steps: int) -> Callable[[dict[str, Any]], None]:
    """Prints each step's metrics record as one progress line."""
    from undertow.learner.metrics_log import format_step

    return lambda record: print(f"undertow train: {format_step(record, num_steps)}", flush=True)


def print_results(run_dir: Path, rollout: RolloutSection) -> None:
    """At the end of a run: the reward curve's PNG, the checkpoint and how to evaluate it."""
    from undertow.learner.checkpoint import latest_checkpoint

    try:
        from undertow.learner.plot import plot_run

        reward_png = next(p for p in plot_run(run_dir) if p.name == "reward.png")
        print(f"undertow train: reward curve {reward_png}", flush=True)
    except (ImportError, FileNotFoundError) as error:
        print(f"undertow train: no plot ({error}); `undertow plot {run_dir}` draws it")
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return
    print(f"undertow train: checkpoint {checkpoint}", flush=True)
    if rollout.source:   # a plugged-in rollout: how to evaluate it is its own business
        return
    if rollout.scaffold == CHAT:
        tasks = f" --tasks {rollout.tasks}" if rollout.tasks else ""
        print(f"undertow train: evaluate it with: undertow chat-eval --model "
              f"{checkpoint / 'model'}{tasks}", flush=True)
    else:
        tasks = f" --tasks {rollout.tasks}" if rollout.tasks else ""
        print(f"undertow train: evaluate it with: undertow eval --model {checkpoint / 'model'}"
              f" --scaffold {rollout.scaffold}{tasks}", flush=True)


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
    from undertow.learner.pool.config import PoolConfig
    from undertow.pool_run import train_with_pool

    pool = build_section(PoolConfig, section, "pool")
    return train_with_pool(pool, sections, model_dir, {**resolved, "pool": asdict(pool)}, stop,
                           resume)
