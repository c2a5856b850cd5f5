"""The protocol every scaffold adapter implements (`Scaffold`, `ScaffoldProcess`) and the
records it exchanges; how a session uses them: docs/adapters.md#scaffolds.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from undertow.sandboxes.sandbox import Sandbox
from undertow.sandboxes.task import Task

# Causes of a scaffold's end, as recorded on the session (`ScaffoldExit.cause`).
EXITED = "exited"            # the scaffold ended by itself with exit code 0
CRASHED = "crashed"          # it ended by itself with a non-zero exit code
TIMEOUT = "timeout"          # it was still running at its time limit and was killed
OUTPUT_FLOOD = "output_flood"  # it wrote more than its output limit and was killed
KILLED = "killed"            # the runner killed it (Ctrl-C, shutdown)


@dataclass(frozen=True)
class Endpoint:
    """The gateway as one session sees it.

    `base_url` is `{gateway}/s/{session_id}/v1` (OpenAI clients use it as is; Anthropic
    clients take `anthropic_base_url`, without the `/v1`). `api_key` reaches only this
    session. `sandbox_base_url` replaces the gateway's address for scaffolds that run
    inside a linked sandbox (whose only peer is the gateway); None otherwise.
    """

    session_id: str
    base_url: str
    api_key: str
    model_name: str = "undertow"
    sandbox_base_url: str | None = None

    @property
    def anthropic_base_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    def inside_sandbox(self) -> "Endpoint":
        """The endpoint with the address a process inside the linked sandbox must use."""
        if self.sandbox_base_url is None:
            raise ValueError("this session's sandbox is not linked to the gateway; "
                             "the scaffold must declare `runs_in_sandbox = True`")
        return Endpoint(self.session_id, self.sandbox_base_url, self.api_key, self.model_name)


@dataclass(frozen=True)
class ScaffoldExit:
    """How a scaffold's process ended.

    Invariants: `cause` is one of EXITED, CRASHED, TIMEOUT, OUTPUT_FLOOD, KILLED;
    `exit_code` is None when the process was killed before it exited by itself;
    `log_tail` is the end of its merged stdout/stderr (bounded), `num_output_bytes`
    everything it wrote; `details` holds what the scaffold itself reported (e.g.
    mini-swe-agent's exit status), JSON-ready.
    """

    cause: str
    exit_code: int | None
    duration_s: float
    num_output_bytes: int = 0
    log_tail: str = ""
    log_path: Path | None = None
    details: dict = field(default_factory=dict)

    @property
    def timed_out(self) -> bool:
        return self.cause == TIMEOUT


class ScaffoldProcess(Protocol):
    """A launched scaffold. `wait` returns once it ends or `timeout_s` passes (then it is
    killed, cause TIMEOUT); `kill` ends it at once (cause KILLED); both are idempotent."""

    async def wait(self, timeout_s: float) -> ScaffoldExit: ...

    async def kill(self) -> None: ...


class Scaffold(Protocol):
    """One kind of agent program. `runs_in_sandbox` asks the runner for a sandbox linked
    to the gateway (the scaffold's process runs inside the container, so its endpoint is
    `endpoint.inside_sandbox()`). `workdir` is a host folder for this session's files
    (configs, logs, trajectories)."""

    @property
    def name(self) -> str: ...

    @property
    def runs_in_sandbox(self) -> bool: ...

    async def launch(self, task: Task, sandbox: Sandbox, endpoint: Endpoint,
                     workdir: Path) -> ScaffoldProcess: ...
