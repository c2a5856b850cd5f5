"""The elastic cell pool: cells, their roles and the policies that move them.

This package holds only pure decision code shared by the live pool and by the simulator
(`undertow.learner.sim`): the roles and the table of legal role changes (`cell`), the snapshot
a policy reads and the decisions it returns (`state`), and the policies (`policy`).
"""

from undertow.learner.pool.cell import TRANSITIONS, Cell, Role, begin_switch, finish_switch
from undertow.learner.pool.errors import IllegalTransition, PolicyConfigError, PoolError
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
    "POLICIES", "TRANSITIONS", "BatchProgress", "Cell", "Colocate", "Decision", "DispatchBatch",
    "Elastic", "IllegalTransition", "MoveToRollout", "MoveToTraining", "Policy",
    "PolicyConfigError", "PoolError", "PoolState", "Role", "Split", "StartTraining",
    "begin_switch", "finish_switch", "make_policy",
]
