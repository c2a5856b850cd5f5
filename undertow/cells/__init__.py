"""The cell pool: the run's one loop (`loop.py`) over a `Pool` (`protocol.py`: `OneCell`,
`CellPool`), the backends that run the cells (`backends.py`), the elastic step and its
members (`elastic/`) and the simulator (`sim/`); docs/cluster.md, "How the cell pool runs".

This module exports the pure decisions the live pool and the simulator share: the roles
and their legal changes (`cell`), the snapshot a policy reads and the decisions it returns
(`state`), the policies (`policy`) and the run config's `pool` section (`config`);
`tests/cells/test_pure.py` checks that they import nothing of the runtime.
"""

from undertow.cells.cell import TRANSITIONS, Cell, Role, begin_switch, finish_switch
from undertow.cells.errors import CellPoolError, IllegalTransition, PolicyConfigError
from undertow.cells.policy import POLICIES, Colocate, Elastic, Policy, Split, make_policy
from undertow.cells.state import (
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
