"""mini-swe-agent (the real package from PyPI, v2.4, unmodified) as a scaffold, run on the host
against the session's endpoint; its command line and config: docs/adapters.md#mini-swe-agent.
"""

import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from undertow.adapters.base import Endpoint, ScaffoldExit
from undertow.adapters.process import HostProcess
from undertow.sandboxes.sandbox import Sandbox
from undertow.sandboxes.task import Task

CONFIG_FILE = Path(__file__).parent / "configs" / "mini_swe_agent.yaml"
# Variables that would point litellm or mini-swe-agent somewhere else than the session.
_DROPPED_ENV = ("OPENAI_BASE_URL", "OPENAI_API_BASE", "MSWEA_MODEL_NAME",
                "MSWEA_MINI_CONFIG_PATH", "LITELLM_MODEL_REGISTRY_PATH")


@dataclass(frozen=True)
class MiniSweAgent:
    """Options: `step_limit` (model calls per session; 0 = none), `max_tokens` per call
    (None: the gateway's default), `temperature`, `command_timeout_s` per shell command,
    `base_config` (mini-swe-agent's prompt config, by its name or a path), and
    `overrides` (more `key=value` specs, e.g. `agent.max_consecutive_format_errors=5`)."""

    step_limit: int = 30
    max_tokens: int | None = None
    temperature: float | None = None
    command_timeout_s: int = 60
    base_config: str = "swebench.yaml"
    overrides: tuple[str, ...] = ()
    python: str = field(default=sys.executable)
    name: str = "mini-swe-agent"
    runs_in_sandbox: bool = False

    def command(self, task: Task, sandbox: Sandbox, endpoint: Endpoint,
                workdir: Path) -> list[str]:
        specs = [
            f"environment.container={sandbox.container_id}",
            f"environment.cwd={sandbox.workdir}",
            f"environment.timeout={self.command_timeout_s}",
            f"model.model_name=openai/{endpoint.model_name}",
            f"model.model_kwargs.api_base={endpoint.base_url}",
            f"agent.step_limit={self.step_limit}",
        ]
        if sandbox.connection.url:  # the sandbox's own Docker host, of several
            specs.append(f"environment.docker_url={sandbox.connection.url}")
        if self.max_tokens is not None:
            specs.append(f"model.model_kwargs.max_tokens={self.max_tokens}")
        if self.temperature is not None:
            specs.append(f"model.model_kwargs.temperature={self.temperature}")
        argv = [self.python, "-m", "minisweagent.run.mini", "-c", self.base_config,
                "-c", str(CONFIG_FILE)]
        for spec in (*specs, *self.overrides):
            argv += ["-c", spec]
        # `--task=TEXT` in one argument: a statement that starts with "-" stays a value.
        return [*argv, f"--task={task.problem_statement}", "-y", "--exit-immediately",
                "-o", str(workdir / "trajectory.json")]

    def environment(self, endpoint: Endpoint, workdir: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        config_dir = workdir / "mini-swe-agent"
        config_dir.mkdir(parents=True, exist_ok=True)
        return {**env, "OPENAI_API_KEY": endpoint.api_key,
                "MSWEA_GLOBAL_CONFIG_DIR": str(config_dir), "MSWEA_CONFIGURED": "true",
                "MSWEA_SILENT_STARTUP": "1", "MSWEA_COST_TRACKING": "ignore_errors",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONUNBUFFERED": "1"}

    async def launch(self, task: Task, sandbox: Sandbox, endpoint: Endpoint,
                     workdir: Path) -> "MiniSweAgentProcess":
        process = await HostProcess.start(
            self.command(task, sandbox, endpoint, workdir),
            env=self.environment(endpoint, workdir), cwd=workdir,
            log_path=workdir / "scaffold.log")
        return MiniSweAgentProcess(process, workdir / "trajectory.json")


@dataclass
class MiniSweAgentProcess:
    """The host process, plus what mini-swe-agent's trajectory file says at the end."""

    process: HostProcess
    trajectory_path: Path

    async def wait(self, timeout_s: float) -> ScaffoldExit:
        return self._with_details(await self.process.wait(timeout_s))

    async def kill(self) -> None:
        await self.process.kill()

    def _with_details(self, exit: ScaffoldExit) -> ScaffoldExit:
        try:
            info = json.loads(self.trajectory_path.read_text())["info"]
        except (OSError, ValueError, KeyError, TypeError):
            return exit
        stats = info.get("model_stats", {})
        return replace(exit, details={"exit_status": info.get("exit_status", ""),
                                      "num_model_calls": stats.get("api_calls", 0),
                                      "trajectory": str(self.trajectory_path)})
