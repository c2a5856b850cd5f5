"""The sandboxes package's errors, in one small hierarchy with one root
(`tests/test_layering.py` checks it).

    SandboxError
    ├── TaskFormatError     a task record is malformed (names the field, instance and line)
    ├── ImageError          building or finding an image failed
    ├── ContainerDied       the container stopped under a running session
    ├── HostLost            the Docker daemon of a sandbox stopped answering
    ├── HostUnavailable     no Docker host of the run answers (`hosts.py`)
    ├── CommandTimeout      a set-up or grading step outlived its time limit
    ├── SetupFailed         a task's start command failed in its container (names both)
    ├── SwebenchMissing     a task is graded by the official harness; `swebench` is not installed
    ├── DroppedRow          a dataset row cannot become a task (`tasks import` counts the reason)
    └── DaemonError         (also a RuntimeError) no Docker daemon, and none could be started
                            (`daemon.py`)
"""


class SandboxError(Exception):
    """Base class of every error raised by `undertow.sandboxes`."""


class TaskFormatError(SandboxError, ValueError):
    """A task record is missing a field or holds a value of the wrong kind."""


class ImageError(SandboxError):
    """An image could not be built or found."""


class ContainerDied(SandboxError):
    """The sandbox's container is no longer running (killed, out of memory, removed)."""


class HostLost(SandboxError):
    """A call to a Docker daemon could not reach it (refused, reset, no socket): its
    sandboxes are lost with it. `Connection.call` raises it, naming the daemon."""


class HostUnavailable(SandboxError):
    """No Docker host of the run answers; the session cannot be placed anywhere."""


class CommandTimeout(SandboxError):
    """A step that must finish (applying a patch, setting up grading) ran past its limit."""


class SetupFailed(SandboxError):
    """One of a task's `start_commands` failed (or ran past its limit) in a container: the
    task cannot be run there; a failure of the task set or the image, not of the agent."""


class SwebenchMissing(SandboxError):
    """A task needs the `swebench` package (its log parser is `swebench...`), and it is not
    installed: pip install 'undertow[swebench]'."""


class DroppedRow(SandboxError):
    """A dataset row that cannot become a task; the message is the reason."""
