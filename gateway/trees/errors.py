"""The tree package's exceptions, one root, no `GatewayError` (docs/design.md, "Errors").

    TreeError          (also a ValueError) a call or record that does not fit the tree
    └── LogLineError   a log line that replay cannot take (`group_log.py`)
"""

from __future__ import annotations


class TreeError(ValueError):
    """A call or record does not fit the tree (bad lengths, unknown anchor or session)."""
