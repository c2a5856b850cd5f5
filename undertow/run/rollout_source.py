"""The rollout source of a training run: groups launched on an asyncio loop, read back as trees.

`undertow/run/train.py` imports it; of the run's modules it imports only the sections, so
the run flows one way.
The learner (sync, main thread) asks `ThreadedGroupSource` to `launch` a group: its
rollout runs on the loop of `background_loop` (a daemon thread running the gateway and
the rollouts), and `wait` reads each finished group's tree from the gateway. What runs a
group is `load_source(context)` (docs/design.md, "Rollout source").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from undertow.run.sections import RolloutSection
from undertow.sandboxes.hosts import HostsConfig

if TYPE_CHECKING:
    from undertow.adapters.chat_rollout import PromptTask
    from undertow.adapters.summary import SessionResult
    from undertow.gateway.trees.tree import Tree
    from undertow.learner.gateway_link import GatewayLink
    from undertow.learner.train import FinishedGroup, GroupRequest

T = TypeVar("T", bound="Task")
Item = TypeVar("Item")
# A group's run on the loop: its name at the gateway, or its outcome.
GroupFuture = concurrent.futures.Future["str | GroupOutcome"]

CHAT = "chat"
CHAT_MULTITURN = "chat-multiturn"   # two calls a session (`adapters/chat_multiturn.py`)
CHAT_SCAFFOLDS = (CHAT, CHAT_MULTITURN)   # the scaffolds that run prompt tasks
DEFAULT_PROMPT_TASKS = "directions.yaml"   # in undertow.adapters.configs


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
    """What a rollout source is given: the gateway, the tasks, where to write.
    `prompt_tasks`: the chat rollouts' tasks, selected once by `undertow train`
    (`select_prompt_tasks`); None: `chat_rollouts` selects them from `rollout`."""

    gateway_url: str
    admin_token: str
    run_dir: Path
    rollout: RolloutSection
    docker_url: str | None
    hosts: HostsConfig | None = None   # None: the one daemon of docker_url
    prompt_tasks: Sequence[PromptTask] | None = None


# A rollout source's coroutine function: runs the group a request names at the gateway.
RunGroup = Callable[["GroupRequest"], Coroutine[Any, Any, "str | GroupOutcome"]]


class Task(Protocol):
    """What task selection reads of a task (a SWE `Task` or a `PromptTask`)."""

    @property
    def instance_id(self) -> str: ...


class ThreadedGroupSource:
    """`GroupSource` over an asyncio loop in another thread (see the module docstring).

    After a resume (`num_resumes` > 0), a launch first looks in the gateway's store
    (replayed by the new gateway) for the same launch index run before the crash: a
    group there whose sessions are all closed, with at least `group_size` valid ones,
    is finished already and is read back instead of being run again."""

    def __init__(self, loop: asyncio.AbstractEventLoop, run_group: RunGroup,
                 admin: GatewayLink, num_resumes: int = 0):
        self.loop, self.run_group, self.admin = loop, run_group, admin
        self.num_resumes = num_resumes
        # (request, its future, rollout seconds) of each finished group
        self.done: queue.Queue[tuple[GroupRequest, GroupFuture, float]] = queue.Queue()
        self.futures: set[GroupFuture] = set()
        self.num_recovered = 0

    def launch(self, request: GroupRequest) -> None:
        started_s = time.perf_counter()
        recovered = self._recovered(request)
        if recovered is not None:
            future: GroupFuture = concurrent.futures.Future()
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

    def wait(self, timeout_s: float) -> list[FinishedGroup]:
        """The groups finished so far (waiting up to `timeout_s` for one). A group whose
        tree the gateway set aside (its store file damaged) comes back empty, its
        `group_size` sessions failed by Undertow (`error:store`), so that the step drops
        and replaces it, counts it and names it in the run's log."""
        from undertow.gateway.trees.tree import Tree
        from undertow.learner.gateway_link import GroupSetAside
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
            try:
                groups.append(self._finished(request, outcome, rollout_s))
            except GroupSetAside as error:  # its store file is damaged: Undertow failed it
                name = outcome if isinstance(outcome, str) else outcome.group
                groups.append(FinishedGroup(
                    request.index, Tree(name), rollout_s, {"error:store": request.group_size},
                    0 if isinstance(outcome, str) else outcome.num_reruns, str(error)))
        return groups

    def _finished(self, request: GroupRequest, outcome: str | GroupOutcome,
                  rollout_s: float) -> FinishedGroup:
        from undertow.learner.train import FinishedGroup

        if isinstance(outcome, str):
            return FinishedGroup(request.index, self.admin.group_tree(outcome), rollout_s)
        return FinishedGroup(request.index, self._tree(outcome), rollout_s,
                             dict(outcome.failures), outcome.num_reruns, outcome.error)

    def _recovered(self, request: GroupRequest) -> str | None:
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

    def _tree(self, outcome: GroupOutcome) -> Tree:
        from undertow.gateway.trees.tree import Tree

        return self.admin.group_tree(outcome.group) if outcome.num_opened else \
            Tree(outcome.group)

    def cancel(self) -> None:
        for future in list(self.futures):
            future.cancel()
        for future in list(self.futures):
            with contextlib.suppress(BaseException):
                future.result(timeout=120)


def outcome_of(group: str, results: Sequence[SessionResult]) -> GroupOutcome:
    """The `GroupOutcome` of a group's `SessionResult`s (every attempt of every slot)."""
    failed = [r for r in results if r.infra_failure]
    return GroupOutcome(group, sum(bool(r.session_id) for r in results),
                        dict(Counter(r.cause for r in failed)),
                        sum(r.attempt > 0 for r in results),
                        next((r.error for r in failed if r.error), ""))


def chat_rollouts(context: RolloutContext) -> RunGroup:
    """`rollout.scaffold: chat`: one-call chat sessions on a prompt task set (or
    `chat-multiturn`: two-call lookup sessions)."""
    from undertow.adapters.chat_multiturn import ChatMultiturnConfig, ChatMultiturnRollout
    from undertow.adapters.chat_rollout import ChatRollout, ChatRolloutConfig
    from undertow.adapters.gateway_client import GatewayAdmin

    section = context.rollout
    multiturn = section.scaffold == CHAT_MULTITURN
    rollout_class = ChatMultiturnRollout if multiturn else ChatRollout
    config_class = ChatMultiturnConfig if multiturn else ChatRolloutConfig
    tasks = select_prompt_tasks(section) if context.prompt_tasks is None else context.prompt_tasks

    async def run_group(request: GroupRequest) -> GroupOutcome:
        config = config_class(group_size=request.group_size,
                                   concurrency=section.concurrency,
                                   timeout_s=section.timeout_s, max_attempts=section.max_attempts,
                                   **section.scaffold_options)
        task = task_at(tasks, request.index, section)
        async with GatewayAdmin(context.gateway_url, context.admin_token) as admin:
            results = await rollout_class(admin, config).run_group(
                task, request.group_id, {"run_group": request.index})
        return outcome_of(request.group_id, results)
    return run_group


def select_prompt_tasks(section: RolloutSection) -> list[PromptTask]:
    """The prompt tasks of `rollout.tasks` (default: the directions task set), filtered."""
    from undertow.adapters import configs
    from undertow.adapters.chat_rollout import load_prompt_tasks

    path = section.tasks or Path(configs.__file__).parent / DEFAULT_PROMPT_TASKS
    return choose_tasks(load_prompt_tasks(path), section.instance_ids, section.num_tasks, path)


def task_at(tasks: Sequence[Item], index: int, section: RolloutSection) -> Item:
    """The task of group `index`. With `rollout.shuffle`, each pass over the tasks goes in
    its own order, drawn from `rollout.seed` and the pass's number: every task once a
    pass, the same order again on resume, and a set sorted by repository does not train
    on its first repository for a whole pass. Else the set's order."""
    num_passes, position = divmod(index, len(tasks))
    if not section.shuffle:
        return tasks[position]
    order = list(range(len(tasks)))
    random.Random(f"{section.seed}:{num_passes}").shuffle(order)
    return tasks[order[position]]


def choose_tasks(tasks: list[T], instance_ids: Sequence[str], num_tasks: int | None,
                 source: Path | str) -> list[T]:
    """The tasks of `instance_ids` (every task when it is empty), in the set's order,
    then the first `num_tasks`: the one task selection of `undertow train` and `undertow
    rollout`. An ID the set lacks, or an empty selection, is a ValueError naming it."""
    if instance_ids:
        missing = sorted(set(instance_ids) - {task.instance_id for task in tasks})
        if missing:
            raise ValueError(f"no task {missing} in {source}; check rollout.tasks and "
                             "instance_ids")
        tasks = [task for task in tasks if task.instance_id in instance_ids]
    tasks = tasks[:num_tasks] if num_tasks else tasks
    if not tasks:
        raise ValueError(f"no task selected from {source}; check rollout.tasks")
    return tasks


def scaffold_rollouts(context: RolloutContext) -> RunGroup:
    """The SWE source: `adapters.rollout.Rollout` of one task per group."""
    from undertow.adapters.gateway_client import GatewayAdmin
    from undertow.adapters.registry import create_scaffold
    from undertow.adapters.rollout import Rollout, RolloutConfig
    from undertow.sandboxes.hosts import DockerHosts
    from undertow.sandboxes.task import load_tasks
    from undertow.sandboxes.taskset import BUNDLED_DIR

    section = context.rollout
    path = section.tasks or BUNDLED_DIR / "tasks.jsonl"
    tasks = choose_tasks(load_tasks(path), section.instance_ids, section.num_tasks, path)
    scaffold = create_scaffold(section.scaffold, section.scaffold_options)
    # One placement for every group, so per-host limits and images hold across groups.
    hosts = DockerHosts.connect(context.hosts or HostsConfig(), context.docker_url)

    async def run_group(request: GroupRequest) -> GroupOutcome:
        config = RolloutConfig(group_size=request.group_size, concurrency=section.concurrency,
                               timeout_s=section.timeout_s, out_dir=context.run_dir / "rollouts",
                               run_id=request.group_id, timeout_value=section.timeout_value,
                               progress_interval_s=0, max_attempts=section.max_attempts,
                               sandbox=section.sandbox)
        task = task_at(tasks, request.index, section)
        async with GatewayAdmin(context.gateway_url, context.admin_token) as admin:
            rollout = Rollout([task], scaffold, admin, hosts, config)
            summary = await rollout.run()
            return outcome_of(rollout.group_name(task), summary.sessions)
    return run_group


def load_source(context: RolloutContext) -> RunGroup:
    """The `run_group` of `context.rollout`: `scaffold: chat` (one chat call a session on a
    prompt task set, `adapters/chat_rollout.py`), a scaffold of `adapters/registry.py`
    (sessions in Docker sandboxes on SWE tasks), or `source: "module:factory"`, where
    `factory(context)` returns an `async run_group(request)` that runs the group and closes
    its sessions with rewards, returning its name at the gateway or a `GroupOutcome`."""
    if not context.rollout.source and context.rollout.scaffold in CHAT_SCAFFOLDS:
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
