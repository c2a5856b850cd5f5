"""Errors of the cell pool (`undertow/cells/`), in one small hierarchy of its own.

    CellPoolError              base of everything the pool raises
    ├── IllegalTransition      a cell was asked to change role along an edge the table lacks
    ├── PolicyConfigError      (also a ValueError) an unknown policy name or a bad parameter
    ├── MemberDeviceError      (also the learner's DeviceError) a device a member cannot use
    ├── MembershipError        the elastic step's members disagree or one is lost
    └── SimulationError        (also a RuntimeError) a simulated run cannot go on
"""


class CellPoolError(Exception):
    """Base of the pool's errors."""


class IllegalTransition(CellPoolError):
    """A role change that `cell.TRANSITIONS` does not allow."""


class PolicyConfigError(CellPoolError, ValueError):
    """A policy spec that names no known policy or carries a bad parameter."""
