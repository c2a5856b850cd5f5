"""The wire of Undertow's KV-transfer extension, shared by its two ends: the built-in engine's
routes (`builtin_engine/undertow_kv.py`, which documents them) and the SGLang driver that
calls them (`engines/sglang.py`, the `KVTransfer` protocol). Like a protocol it sits below
both, so that the engine server imports nothing of the gateway's engine side (docs/design.md,
"Layout"; docs/engines.md, "KV transfer").
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence

__all__ = ["KV_END_HEADER", "KV_START_HEADER", "KV_TRANSFER", "PrefixDigest"]

KV_TRANSFER = "kv_transfer"  # the extension's name in `GET /server_info`'s `undertow_extensions`
KV_START_HEADER = "X-Undertow-KV-Start"  # an exported payload's span: first position
KV_END_HEADER = "X-Undertow-KV-End"  # and the position after its last


class PrefixDigest:
    """A running digest of a sequence's first `num_tokens` token IDs (BLAKE2b of int64
    little-endian), fed span by span: the same IDs give the same digest however they were cut
    into spans. Both ends of a KV staging compute it, each from its own record of the IDs, so
    that a resume can only continue the prefix it names."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)
        self.num_tokens = 0

    def update(self, token_ids: Sequence[int]) -> None:
        data = array.array("q", token_ids)
        if sys.byteorder != "little":
            data.byteswap()
        self._hash.update(data)
        self.num_tokens += len(token_ids)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()
