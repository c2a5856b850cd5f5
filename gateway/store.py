"""The tree store: every group's prefix tree in memory, written ahead to disk.

Layout: one JSON-lines file per task group, `STORE/<group>.jsonl`. Each line is an
event: `session_open` (ID, group, the SHA-256 of its key, metadata), `call` (a
`CallRecord`: only the tokens new to the tree, so the file grows with unique
tokens), or `session_close` (reward, metadata).

Write-ahead: `append` returns only after the line is written, flushed and
fsync'ed; the API sends the last byte of a reply only after that. With
`sync="flush"` the line is handed to the operating system but not fsync'ed: a
delivered call still survives the gateway being killed (SIGKILL), not the machine
losing power, and a call is ~3 ms faster on a disk whose fsync takes that long. One writer task
commits lines in the order they were queued (group commit: one fsync per file per
batch), so a group's file holds its records in the order they were applied to the
tree, which replay needs to rebuild the same node IDs.

On start-up `replay` reads every file; a torn last line (the process died while
writing it; its reply was never sent) is cut off.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from undertow.gateway.errors import BadRequest
from undertow.gateway.tree import CallRecord, Tree

SYNC_MODES = ("fsync", "flush")
GROUP_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_group(group: str) -> str:
    if not isinstance(group, str) or not GROUP_PATTERN.match(group):
        raise BadRequest(f"group {group!r} must be 1-128 characters of letters, digits, '.', "
                         "'_' or '-', starting with a letter or digit", param="group")
    return group


@dataclass
class _Pending:
    group: str
    line: bytes
    done: asyncio.Future = field(repr=False)


class TreeStore:
    """Trees by group, plus their write-ahead log under `directory`."""

    def __init__(self, directory: Path, create: bool = True, sync: str = "fsync"):
        if sync not in SYNC_MODES:
            raise ValueError(f"sync={sync!r}: choose one of {SYNC_MODES}")
        self.sync = sync
        self.directory = Path(directory)
        if create:
            self.directory.mkdir(parents=True, exist_ok=True)
        elif not self.directory.is_dir():
            raise FileNotFoundError(f"no tree store at {self.directory}")
        self.trees: dict[str, Tree] = {}
        self._files: dict[str, BinaryIO] = {}
        self._queue: list[_Pending] = []
        self._wakeup: asyncio.Event | None = None
        self._writer: asyncio.Task | None = None

    def tree(self, group: str) -> Tree:
        if group not in self.trees:
            self.trees[group] = Tree(check_group(group))
        return self.trees[group]

    def replay(self, repair: bool = True) -> Iterator[dict[str, Any]]:
        """Rebuilds every tree from disk; yields every event (with its `group`) after
        applying it, so that a `call` event's call is the last of its tree's calls.
        `repair` cuts a torn last line off its file (readers pass False)."""
        for path in sorted(self.directory.glob("*.jsonl")):
            group = path.stem
            tree = self.tree(group)
            for event in _read_events(path, repair):
                if event["kind"] == "call":
                    tree.apply(CallRecord.from_json(event))
                elif event["kind"] == "session_close":
                    tree.close_session(event["session_id"], event["reward"], event.get("meta"))
                event["group"] = group
                yield event

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._writer = asyncio.create_task(self._write_forever(), name="tree-store-writer")

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
            self._writer = None
        if self._queue:
            self._write_batch(self._queue)
            self._queue = []
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def submit(self, group: str, event: dict[str, Any]) -> asyncio.Future:
        """Queues one event line now (so lines keep the order of the calls to `submit`);
        the future resolves once it is on disk (fsync'ed)."""
        if self._wakeup is None:
            raise RuntimeError("TreeStore.start() must run before submit()")
        line = (json.dumps(event, ensure_ascii=False, separators=(",", ":"),
                           allow_nan=False) + "\n").encode()
        pending = _Pending(group, line, asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        self._wakeup.set()
        return pending.done

    async def append(self, group: str, event: dict[str, Any]) -> None:
        """Writes one event line and waits until it is on disk."""
        await asyncio.shield(self.submit(group, event))

    async def _write_forever(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            batch, self._queue = self._queue, []
            if not batch:
                continue
            try:
                if self.sync == "fsync":
                    await asyncio.to_thread(self._write_batch, batch)
                else:
                    self._write_batch(batch)
            except OSError as error:
                for pending in batch:
                    if not pending.done.done():
                        pending.done.set_exception(error)
                continue
            for pending in batch:
                if not pending.done.done():
                    pending.done.set_result(None)

    def _write_batch(self, batch: list[_Pending]) -> None:
        touched: dict[str, BinaryIO] = {}
        for pending in batch:
            handle = self._files.get(pending.group)
            if handle is None:
                handle = open(self.directory / f"{pending.group}.jsonl", "ab")  # noqa: SIM115
                self._files[pending.group] = handle
            handle.write(pending.line)
            touched[pending.group] = handle
        for handle in touched.values():
            handle.flush()
            if self.sync == "fsync":
                os.fsync(handle.fileno())


def _read_events(path: Path, repair: bool) -> Iterator[dict[str, Any]]:
    """Events of one file; a torn last line is skipped (and cut off, with `repair`)."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data) and repair:
        with open(path, "r+b") as handle:
            handle.truncate(end)
    for line in data[:end].splitlines():
        if line.strip():
            yield json.loads(line)
