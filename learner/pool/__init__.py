"""The elastic cell pool's decisions: cells, their roles and the policies that move them.

This package holds only pure decision code, shared by the live pool (`learner/elastic/`,
which carries the decisions out) and by the simulator (`learner/sim/`): the roles and the
table of legal role changes (`cell`), the snapshot a policy reads and the decisions it
returns (`state`), the policies (`policy`) and the run config's `pool` section (`config`).
`tests/test_layering.py` checks that it imports nothing outside itself but the learner's
errors.
"""

from undertow.learner.pool.cell import TRANSITIONS, Cell, Role, begin_switch, finish_switch
from undertow.learner.pool.errors import CellPoolError, IllegalTransition, PolicyConfigError
from undertow.learner.pool.policy import POLICIES, Colocate, Elastic, Policy, Split, make_policy
from undertow.learner.pool.state import (
    BatchProgress,
    Decision,
    DispatchBatch,
    MoveToRollout,
    MoveToTraining,
    PoolState,
    StartTraining,
)

__all__ = [
    "POLICIES",
    "TRANSITIONS",
    "BatchProgress",
    "Cell",
    "CellPoolError",
    "Colocate",
    "Decision",
    "DispatchBatch",
    "Elastic",
    "IllegalTransition",
    "MoveToRollout",
    "MoveToTraining",
    "Policy",
    "PolicyConfigError",
    "PoolState",
    "Role",
    "Split",
    "StartTraining",
    "begin_switch",
    "finish_switch",
    "make_policy",
]
