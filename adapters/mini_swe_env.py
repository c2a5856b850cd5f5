"""The environment mini-swe-agent runs its commands in, chosen by import path from its config:
the session's sandbox container, which it never starts or removes (docs/adapters.md#mini-swe-agent).
"""

import asyncio
import platform
from typing import Any

from undertow.sandboxes.connection import connect
from undertow.sandboxes.sandbox import Sandbox, SandboxConfig

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class SandboxEnvironment:
    """Runs mini-swe-agent's actions in an existing sandbox container.

    Keyword arguments come from mini-swe-agent's `environment` config section:
    `container` (ID or name, required), `cwd` (default `/testbed`), `timeout` (seconds
    per command), `env` (variables set for each command), `max_output_bytes`,
    `docker_url`; other keys (e.g. from a shared YAML) are kept for templates only.
    """

    def __init__(self, *, container: str, cwd: str = "/testbed", timeout: int = 60,
                 env: dict[str, str] | None = None, max_output_bytes: int = 256 * 2**10,
                 docker_url: str | None = None, **extra: object):
        self.config: dict[str, Any] = {"container": container, "cwd": cwd, "timeout": timeout,
                       "env": dict(env or {}), "max_output_bytes": max_output_bytes, **extra}
        self._connection = connect(docker_url)
        handle = self._connection.client.containers.get(container)
        self._sandbox = Sandbox(self._connection, handle, cwd, "",
                                SandboxConfig(max_output_bytes=max_output_bytes), uid=0, gid=0)

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None
                ) -> dict[str, Any]:
        command = action.get("command", "")
        limit_s = timeout or self.config["timeout"]
        try:
            result = asyncio.run(self._sandbox.exec(
                command, timeout_s=limit_s, workdir=cwd or self.config["cwd"],
                env=self.config["env"]))
        except Exception as error:  # the container died: tell the model, as docker's env does
            output = {"output": "", "returncode": -1,
                      "exception_info": f"An error occurred while executing the command: {error}",
                      "extra": {"exception_type": type(error).__name__,
                                "exception": str(error)}}
        else:
            info = (f"The command ran past {limit_s} s and was killed with its processes."
                    if result.timed_out else "")
            output = {"output": result.output, "returncode": result.exit_code,
                      "exception_info": info}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            from minisweagent.exceptions import Submitted

            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: object) -> dict[str, Any]:
        return {**self.config, **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "environment": {k: v for k, v in self.config.items() if k != "env"},
            "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}
