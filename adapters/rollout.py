"""The rollout runner (`Rollout`): every task `group_size` times, each session in its own
sandbox, against a gateway reached over HTTP. A session top to bottom, failures of Undertow's
own, hosts, tree estimates and cancelling: docs/adapters.md#the-rollout-runner.
"""

import asyncio
import contextlib
import sys
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO
from urllib.parse import urlsplit

from undertow.adapters.base import Endpoint, Scaffold, ScaffoldExit
from undertow.adapters.errors import RolloutError
from undertow.adapters.gateway_client import GatewayAdmin
from undertow.adapters.process import stop_sandbox_processes
from undertow.adapters.summary import Progress, RolloutSummary, SessionResult, gateway_errors
from undertow.adapters.tree_value import estimate_tree_value
from undertow.sandboxes.connection import Connection
from undertow.sandboxes.errors import ContainerDied, HostLost
from undertow.sandboxes.grading import Grade, GradingConfig, grade
from undertow.sandboxes.hosts import DockerHost, DockerHosts
from undertow.sandboxes.link import GatewayRelay, start_linked_sandbox
from undertow.sandboxes.sandbox import Sandbox, SandboxConfig
from undertow.sandboxes.task import Task
from undertow.sandboxes.task_setup import prepare_session_sandbox

TIMEOUT_VALUES = ("partial_credit", "tree_estimate")
# Task images are built once each; more builds at once only compete for the CPUs.
NUM_PARALLEL_IMAGE_BUILDS = 2


@dataclass(frozen=True)
class RolloutConfig:
    """How a rollout runs. `out_dir` receives each session's folder (scaffold log,
    trajectory) and `summary.json`; `timeout_value` chooses the reward of timed-out
    sessions; `progress_interval_s` of 0 prints no progress."""

    group_size: int = 1
    concurrency: int = 1
    timeout_s: float = 600.0
    out_dir: Path = Path("rollouts")
    run_id: str = ""
    model_name: str = "undertow"
    timeout_value: str = "partial_credit"
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    grading: GradingConfig = field(default_factory=GradingConfig)
    progress_interval_s: float = 5.0
    max_attempts: int = 3

    def __post_init__(self):
        for name in ("group_size", "concurrency", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.timeout_s <= 0:
            raise ValueError(f"RolloutConfig.timeout_s must be positive, got {self.timeout_s}")
        if self.timeout_value not in TIMEOUT_VALUES:
            raise ValueError(f"RolloutConfig.timeout_value must be one of {TIMEOUT_VALUES}, "
                             f"got {self.timeout_value!r}")


def failure_reason(error: BaseException) -> str:
    """What went wrong, never empty: the error's type and message, and the errors it was
    raised from; one without a message (a bare TimeoutError) also says where it was
    raised (file, line and function of the innermost frame)."""
    reasons: list[str] = []
    link: BaseException | None = error
    while link is not None and len(reasons) < 4:
        message = str(link).strip()
        if not message:
            frame = traceback.extract_tb(link.__traceback__)[-1:] if link.__traceback__ else []
            message = (f"(no message) raised at {Path(frame[0].filename).name}:"
                       f"{frame[0].lineno} in {frame[0].name}" if frame else "(no message)")
        reasons.append(f"{type(link).__name__}: {message}")
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    return "; from ".join(reasons)


def new_run_id() -> str:
    return f"rollout-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


class Rollout:
    """One run of `tasks` x `group_size` sessions of `scaffold`. Call `await run()` once."""

    def __init__(self, tasks: Sequence[Task], scaffold: Scaffold, admin: GatewayAdmin,
                 connection: Connection | DockerHosts,
                 config: RolloutConfig = RolloutConfig(),
                 progress_stream: TextIO | None = None):
        if not tasks:
            raise RolloutError("no tasks to run; check the --tasks path")
        self.tasks, self.scaffold, self.admin = list(tasks), scaffold, admin
        self.hosts = (connection if isinstance(connection, DockerHosts)
                      else DockerHosts.of(connection))
        self.config = config
        self.run_id = config.run_id or new_run_id()
        # absolute: each scaffold runs in its session's folder, so a relative path given
        # to it (mini-swe-agent's `-o trajectory.json`) would land one folder deeper
        self.out_dir = Path(config.out_dir).resolve() / self.run_id
        self.progress = Progress(len(self.tasks), len(self.tasks) * config.group_size,
                                 progress_stream if progress_stream is not None else sys.stderr,
                                 config.progress_interval_s)
        self._slots = asyncio.Semaphore(config.concurrency)
        self._builds = asyncio.Semaphore(NUM_PARALLEL_IMAGE_BUILDS)
        self._link: GatewayRelay | None = None
        self.results: list[SessionResult] = []

    async def run(self) -> RolloutSummary:
        started = time.monotonic()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        interrupted = False
        reporter = asyncio.ensure_future(self._report())
        try:
            if getattr(self.scaffold, "runs_in_sandbox", False):
                gateway = urlsplit(self.admin.url)
                if not gateway.hostname:
                    raise RolloutError(f"the gateway URL {self.admin.url!r} names no host; "
                                       "give it as http://HOST:PORT")
                self._link = await GatewayRelay(gateway.hostname, gateway.port or 80).start()
            # A TaskGroup, not gather: on cancellation it waits for every session's
            # clean-up, where gather returns as soon as the first child is cancelled.
            async with asyncio.TaskGroup() as groups:
                for task in self.tasks:
                    groups.create_task(self._group(task))
        except asyncio.CancelledError:
            interrupted = True
            raise
        finally:
            reporter.cancel()
            await self._shutdown()
            summary = RolloutSummary(self.run_id, self.scaffold.name,
                                     time.monotonic() - started, self.results, interrupted)
            (self.out_dir / "summary.json").write_text(summary.dumps())
            self.progress.print()
        return summary

    async def _report(self) -> None:
        while self.config.progress_interval_s > 0:
            await asyncio.sleep(self.config.progress_interval_s)
            self.progress.print()

    async def _shutdown(self) -> None:
        if self._link is not None:
            await self._link.close()
        # Grading or set-up containers caught mid-start by a cancellation, if any.
        with contextlib.suppress(Exception):
            await self.hosts.gc(self.run_id)

    def group_name(self, task: Task) -> str:
        name = "".join(c if c.isalnum() or c in "._-" else "-" for c in task.instance_id)
        return f"{self.run_id}.{name}"[:128]

    async def _group(self, task: Task) -> None:
        results: list[SessionResult] = []
        try:
            async with asyncio.TaskGroup() as sessions:
                for index in range(self.config.group_size):
                    sessions.create_task(self._slot(task, index, results))
        finally:
            await asyncio.shield(self._close_deferred(task, results))
            self.progress.num_tasks_done += 1

    async def _image(self, task: Task, host: DockerHost) -> str:
        """The task's image on `host` (built there once; a failed build is tried again)."""
        async with self._builds:
            return await self.hosts.image(host, task)

    async def _slot(self, task: Task, index: int, results: list[SessionResult]) -> None:
        """Attempts of one slot of the group until one ends with an outcome the policy
        earned (or `max_attempts` are spent)."""
        for attempt in range(self.config.max_attempts):
            result = SessionResult(task.instance_id, index, attempt=attempt)
            results.append(result)
            self.results.append(result)
            await self._session(task, result)
            if not result.infra_failure:
                return

    async def _session(self, task: Task, result: SessionResult) -> None:
        async with self._slots:
            self.progress.num_running += 1
            started = time.monotonic()
            try:
                await self._placed_session(task, result)
            except asyncio.CancelledError:
                result.cause = "interrupted"
                raise
            finally:
                result.duration_s = time.monotonic() - started
                self.progress.num_running -= 1
                self.progress.ended.append(result)
                if result.session_id and not self._defers(result):
                    await asyncio.shield(self._close(result))

    def _defers(self, result: SessionResult) -> bool:
        return result.timed_out and self.config.timeout_value == "tree_estimate"

    async def _placed_session(self, task: Task, result: SessionResult) -> None:
        """The session on a host of its own; a failure of Undertow's pings that host."""
        try:
            async with self.hosts.place() as host:
                await self._run_session(task, host, result)
                result.details = {**result.details, "docker_host": host.url}
                if result.infra_failure and result.cause != "interrupted":
                    await self.hosts.check(host)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # no host could be had
            self._failed(result, "sandbox", failure_reason(error))

    async def _run_session(self, task: Task, host: DockerHost,
                           result: SessionResult) -> None:
        stage = "open"
        sandbox: Sandbox | None = None
        try:
            opened = await self.admin.open_session(
                self.group_name(task), {"run": self.run_id, "instance_id": task.instance_id,
                                         "index": result.index, "scaffold": self.scaffold.name})
            result.session_id = opened["session_id"]
            stage = "image"
            image = await self._image(task, host)
            stage = "sandbox"
            sandbox = await self._start_sandbox(task, host, image, result.session_id)
            stage = "setup"
            await prepare_session_sandbox(sandbox, task, image, self._session_dir(result)
                                          / "sandbox.log")
            endpoint = Endpoint(opened["session_id"], opened["base_url"], opened["api_key"],
                                self.config.model_name, sandbox.gateway_url and
                                f"{sandbox.gateway_url}/s/{opened['session_id']}/v1")
            stage = "scaffold"
            exit = await self._run_scaffold(task, sandbox, endpoint, result)
            stage = "gateway"
            if await self._failed_by_gateway(result):
                return
            stage = "grade"
            await self._grade(task, host, image, sandbox, exit, result)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a lost container or Docker host: `error:sandbox`
            lost = isinstance(error, ContainerDied | HostLost)
            self._failed(result, "sandbox" if lost else stage, failure_reason(error))
        finally:
            if sandbox is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(sandbox.close())

    async def _failed_by_gateway(self, result: SessionResult) -> bool:
        """Whether the gateway failed the scaffold's calls (error replies of its own,
        which it noted on the session: `gateway_errors`). Then how the scaffold ended is
        Undertow's doing, not the policy's: the session is not graded, its cause is
        `error:gateway` (the scaffold's own stays in `scaffold_cause`), and its slot runs
        again."""
        reasons = gateway_errors(await self.admin.session(result.session_id))
        if reasons:
            result.scaffold_cause = result.cause
            self._failed(result, "gateway", f"the gateway failed this session's calls: "
                                            f"{reasons}")
        return bool(reasons)

    def _failed(self, result: SessionResult, stage: str, reason: str) -> None:
        """A failure of Undertow's own at `stage`: the cause, and its reason in the
        session's record and at the end of its sandbox log."""
        result.cause, result.error = f"error:{stage}", reason
        if result.session_id:
            log_path = self._session_dir(result) / "sandbox.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with log_path.open("a", encoding="utf-8") as log:
                log.write(f"# {result.cause}: {result.error}\n")

    async def _start_sandbox(self, task: Task, host: DockerHost, image: str,
                             session_id: str) -> Sandbox:
        if self._link is not None:
            return await start_linked_sandbox(
                host.connection, image, self._link, run=self.run_id, session=session_id,
                workdir=task.workdir, base_commit=task.base_commit, config=self.config.sandbox)
        return await Sandbox.start(
            host.connection, image, run=self.run_id, session=session_id, workdir=task.workdir,
            base_commit=task.base_commit, config=self.config.sandbox)

    def _session_dir(self, result: SessionResult) -> Path:
        return self.out_dir / "sessions" / result.session_id

    async def _run_scaffold(self, task: Task, sandbox: Sandbox, endpoint: Endpoint,
                            result: SessionResult) -> ScaffoldExit:
        workdir = self._session_dir(result)
        workdir.mkdir(parents=True, exist_ok=True)
        process = await self.scaffold.launch(task, sandbox, endpoint, workdir)
        try:
            exit = await process.wait(self.config.timeout_s)
        except asyncio.CancelledError:
            await asyncio.shield(process.kill())
            raise
        result.cause, result.exit_code = exit.cause, exit.exit_code
        result.num_output_bytes, result.log_tail = exit.num_output_bytes, exit.log_tail
        result.details = exit.details
        return exit

    async def _grade(self, task: Task, host: DockerHost, image: str, sandbox: Sandbox,
                     exit: ScaffoldExit, result: SessionResult) -> None:
        # Nothing may change the sandbox between the cut-off and the diff.
        await stop_sandbox_processes(sandbox)
        diff = await sandbox.diff()
        verdict: Grade = await grade(host.connection, task, diff, run=self.run_id,
                                     config=self.config.grading, timed_out=exit.timed_out,
                                     image=image)
        result.reward, result.resolved = verdict.reward, verdict.resolved
        result.reward_source = "partial_credit" if exit.timed_out else "grade"
        result.partial_credit = verdict.reward if exit.timed_out else None
        result.grade_reason, result.tests = verdict.reason, verdict.tests
        result.details = {**result.details, "diff": diff[-20000:]}

    async def _count_tokens(self, result: SessionResult) -> None:
        tree = await self.admin.session_tree(result.session_id)
        calls = tree.get("calls", [])
        result.num_calls = len(calls)
        result.num_prompt_tokens = sum(call["num_prompt_tokens"] for call in calls)
        result.num_completion_tokens = sum(call["num_completion_tokens"] for call in calls)

    async def _close(self, result: SessionResult) -> None:
        if result.closed:
            return
        try:
            await self._count_tokens(result)
            closed = await self.admin.close_session(result.session_id, result.reward,
                                                    result.meta())
            result.take_verdict(closed.get("meta") or {})
            result.closed = True
        except Exception as error:
            result.error = result.error or f"closing at the gateway failed: {error}"

    async def _close_deferred(self, task: Task, results: list[SessionResult]) -> None:
        waiting = [r for r in results if r.session_id and not r.closed]
        if not waiting:
            return
        finished = {r.session_id: r.reward for r in results
                    if r.closed and r.cause not in ("timeout", "interrupted")
                    and not r.cause.startswith("error:")}
        tree = None
        if finished and any(r.timed_out for r in waiting):
            with contextlib.suppress(Exception):
                tree = await self.admin.group_tree(self.group_name(task))
        for result in waiting:
            estimate = (estimate_tree_value(tree, result.session_id, finished)
                        if tree and result.timed_out else None)
            if estimate is not None:
                result.tree_value = {"value": estimate.value,
                                     "num_shared_tokens": estimate.num_shared_tokens,
                                     "num_sessions": estimate.num_sessions}
                result.reward, result.reward_source = estimate.value, "tree_estimate"
            await self._close(result)
