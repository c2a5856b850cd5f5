"""The tree package's exceptions, one root (`tests/test_layering.py` checks it). Not a
`GatewayError`: the trees import nothing else of the gateway, so that the learner depends on
them alone; where the front records a call it becomes a `GatewayError` (500) there, once.

    TreeError          (also a ValueError) a call or record that does not fit the tree
    └── LogLineError   a log line that replay cannot take (`group_log.py`)
"""

from __future__ import annotations


class TreeError(ValueError):
    """A call or record does not fit the tree (bad lengths, unknown anchor or session)."""
