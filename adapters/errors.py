"""The adapters package's errors, in one small hierarchy.

    AdapterError
    ├── ScaffoldLaunchError   a scaffold could not be started (program missing, bad template)
    ├── GatewayAdminError     the gateway's admin API refused or failed a call
    ├── RolloutError          a rollout cannot run as configured (no tasks, bad scaffold name)
    └── RewardError           a prompt task's reward function failed on one session

A scaffold that crashes, hangs or floods its output is no error: it is the session's cause.
"""


class AdapterError(Exception):
    """Base class of every error raised by `undertow.adapters`."""


class ScaffoldLaunchError(AdapterError):
    """The scaffold's process could not be started."""


class GatewayAdminError(AdapterError):
    """An admin call to the gateway failed; the message holds its status and body."""


class RolloutError(AdapterError, ValueError):
    """The rollout's configuration or inputs are unusable."""


class RewardError(AdapterError):
    """A reward function failed on one session (the session's cause: `error:reward`,
    `chat_rollout.py`)."""
