"""Any program as a scaffold (`CommandScaffold`): a templated command line plus the usual
environment. The placeholders and the variables: docs/adapters.md#any-program-command.
"""

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from undertow.adapters.base import Endpoint, ScaffoldProcess
from undertow.adapters.errors import ScaffoldLaunchError
from undertow.adapters.process import HostProcess, SandboxProcess
from undertow.sandboxes.sandbox import Sandbox
from undertow.sandboxes.task import Task

PLACEHOLDERS = ("base_url", "anthropic_base_url", "api_key", "model", "session_id",
                "instance_id", "problem_file", "repo_dir", "container", "session_dir")
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
SANDBOX_PROBLEM_FILE = "/tmp/undertow-problem.md"


def render_template(template: str, values: Mapping[str, str]) -> str:
    """Replaces the known `{name}` placeholders; every other character stays as is."""
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


@dataclass(frozen=True)
class CommandScaffold:
    """`command` (a bash command line with placeholders), run `where` ("host" or
    "sandbox"), with extra `env` (templated too) and, on the host, `max_output_bytes`
    before it is killed for flooding."""

    command: str
    where: str = "host"
    env: Mapping[str, str] = field(default_factory=dict)
    max_output_bytes: int = 64 * 2**20
    name: str = "command"

    def __post_init__(self):
        if self.where not in ("host", "sandbox"):
            raise ValueError(f"CommandScaffold.where must be 'host' or 'sandbox', "
                             f"got {self.where!r}")
        if not self.command.strip():
            raise ValueError("CommandScaffold.command is empty; give the program to run")

    @property
    def runs_in_sandbox(self) -> bool:
        return self.where == "sandbox"

    def values(self, task: Task, sandbox: Sandbox, endpoint: Endpoint,
               workdir: Path) -> dict[str, str]:
        problem_file = (SANDBOX_PROBLEM_FILE if self.runs_in_sandbox
                        else str(workdir / "problem.md"))
        return {"base_url": endpoint.base_url, "anthropic_base_url": endpoint.anthropic_base_url,
                "api_key": endpoint.api_key, "model": endpoint.model_name,
                "session_id": endpoint.session_id, "instance_id": task.instance_id,
                "problem_file": problem_file, "repo_dir": sandbox.workdir,
                "container": sandbox.container_id, "session_dir": str(workdir)}

    def environment(self, values: Mapping[str, str]) -> dict[str, str]:
        env = {"OPENAI_BASE_URL": values["base_url"], "OPENAI_API_KEY": values["api_key"],
               "ANTHROPIC_BASE_URL": values["anthropic_base_url"],
               "ANTHROPIC_API_KEY": values["api_key"], "OPENAI_MODEL": values["model"],
               "UNDERTOW_SESSION_ID": values["session_id"]}
        return {**env, **{k: render_template(v, values) for k, v in self.env.items()}}

    async def launch(self, task: Task, sandbox: Sandbox, endpoint: Endpoint,
                     workdir: Path) -> ScaffoldProcess:
        if self.runs_in_sandbox:
            endpoint = endpoint.inside_sandbox()
        values = self.values(task, sandbox, endpoint, workdir)
        command = render_template(self.command, values)
        env = self.environment(values)
        log_path = workdir / "scaffold.log"
        if self.runs_in_sandbox:
            await sandbox.write_file(SANDBOX_PROBLEM_FILE, task.problem_statement)
            return SandboxProcess(sandbox, command, env, log_path)
        Path(values["problem_file"]).write_text(task.problem_statement, encoding="utf-8")
        try:
            return await HostProcess.start(["bash", "-c", command], env={**os.environ, **env},
                                           cwd=workdir, log_path=log_path,
                                           max_output_bytes=self.max_output_bytes)
        except ScaffoldLaunchError:
            raise ScaffoldLaunchError("cannot start bash to run the command; install bash") \
                from None
