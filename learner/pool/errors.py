"""Errors of the cell pool, under the learner's root (`learner/errors.py`).

    LearnerError
    └── CellPoolError          base of everything the pool raises
        ├── IllegalTransition  a cell was asked to change role along an edge the table lacks
        └── PolicyConfigError  (also a ValueError) an unknown policy name or a bad parameter
"""

from undertow.learner.errors import LearnerError


class CellPoolError(LearnerError):
    """Base of the pool's errors."""


class IllegalTransition(CellPoolError):
    """A role change that `cell.TRANSITIONS` does not allow."""


class PolicyConfigError(CellPoolError, ValueError):
    """A policy spec that names no known policy or carries a bad parameter."""
