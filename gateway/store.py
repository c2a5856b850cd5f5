"""The tree store: every group's prefix tree in memory, written ahead to disk.

Layout: one JSON-lines file per task group, `STORE/<group>.jsonl`. Each line is an
event: `session_open` (ID, group, the SHA-256 of its key, metadata), `call` (a
`CallRecord`: only the tokens new to the tree, so the file grows with unique
tokens), or `session_close` (reward, metadata).

Write-ahead: a call's line is written before the API sends the last byte of its
reply. What "written" means is the store's `sync` mode:

- `flush` (the default): `submit` hands the line to the operating system at once
  (`write(2)` on the group's file, before it returns), so a delivered call survives
  the gateway being killed (SIGKILL, a crash, OOM): the kernel holds the bytes. The
  files are fsync'ed in the background, grouped, at most `fsync_interval_s` after a
  write, and on `close`; so a power loss or kernel crash can lose the calls of the
  last `fsync_interval_s` (1 s), delivered or not. The reply waits for no disk.
- `fsync`: the reply waits until its line is fsync'ed, so a delivered call also
  survives a power loss; one writer task commits lines in the order they were queued
  (group commit: one fsync per file per batch). It costs a call one fsync
  (milliseconds on a slow disk).

Either way a group's file holds its records in the order they were applied to the
tree, which replay needs to rebuild the same node IDs.

On start-up `replay` reads every file; a torn last line (the process died while
writing it; its reply was never sent) is cut off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from undertow.gateway.errors import BadRequest
from undertow.gateway.tree import CallRecord, Tree

log = logging.getLogger(__name__)
SYNC_MODES = ("flush", "fsync")
FSYNC_INTERVAL_S = 1.0
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
    """Trees by group, plus their write-ahead log under `directory` (see the module
    docstring for what each `sync` mode guarantees)."""

    def __init__(self, directory: Path, create: bool = True, sync: str = "flush",
                 fsync_interval_s: float = FSYNC_INTERVAL_S):
        if sync not in SYNC_MODES:
            raise ValueError(f"sync={sync!r}: choose one of {SYNC_MODES}")
        if fsync_interval_s < 0:
            raise ValueError(f"fsync_interval_s={fsync_interval_s} must be >= 0")
        self.sync = sync
        self.fsync_interval_s = fsync_interval_s
        self.directory = Path(directory)
        if create:
            self.directory.mkdir(parents=True, exist_ok=True)
        elif not self.directory.is_dir():
            raise FileNotFoundError(f"no tree store at {self.directory}")
        self.trees: dict[str, Tree] = {}
        self._files: dict[str, BinaryIO] = {}
        self._queue: list[_Pending] = []  # `fsync` mode: lines not yet written
        self._unsynced: set[str] = set()  # `flush` mode: groups written since their fsync
        self._wakeup: asyncio.Event | None = None
        self._closing: asyncio.Event | None = None
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
        self._wakeup, self._closing = asyncio.Event(), asyncio.Event()
        self._writer = asyncio.create_task(self._write_forever(), name="tree-store-writer")

    async def close(self) -> None:
        """Writes and fsyncs whatever is pending, then closes the files."""
        if self._writer is not None:
            self._closing.set()
            self._wakeup.set()
            await asyncio.gather(self._writer, return_exceptions=True)
            self._writer = None
        if self._queue:
            self._write_batch(self._queue)
            self._queue = []
        self._fsync_files(self._take_unsynced())
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def submit(self, group: str, event: dict[str, Any]) -> asyncio.Future:
        """Writes (`flush`) or queues (`fsync`) one event line now, so that lines keep
        the order of the calls to `submit`; the future resolves once the line is as
        durable as the mode promises (at once for `flush`: the OS has it)."""
        if self._wakeup is None:
            raise RuntimeError("TreeStore.start() must run before submit()")
        # orjson writes NaN as null: records keep non-finite numbers out (`Tree.add_call`).
        line = orjson.dumps(event, option=orjson.OPT_APPEND_NEWLINE)
        done = asyncio.get_running_loop().create_future()
        if self.sync == "flush":
            handle = self._file(group)
            handle.write(line)
            handle.flush()
            self._unsynced.add(group)
            done.set_result(None)
        else:
            self._queue.append(_Pending(group, line, done))
        self._wakeup.set()
        return done

    async def append(self, group: str, event: dict[str, Any]) -> None:
        """Writes one event line and waits until it is as durable as the mode promises."""
        await asyncio.shield(self.submit(group, event))

    async def _write_forever(self) -> None:
        """`fsync` mode: commits queued lines in batches. `flush` mode: fsyncs written
        files, at most `fsync_interval_s` after their first unsynced write."""
        while not self._closing.is_set():
            await self._wakeup.wait()
            self._wakeup.clear()
            if self.sync == "fsync":
                await self._commit_queue()
            elif self._unsynced:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), self.fsync_interval_s)
                try:
                    await asyncio.to_thread(self._fsync_files, self._take_unsynced())
                except OSError as error:
                    log.error("tree store: fsync failed (%s); calls written since the last "
                              "fsync are safe from a gateway crash, not from a power loss",
                              error)

    async def _commit_queue(self) -> None:
        batch, self._queue = self._queue, []
        if not batch:
            return
        try:
            await asyncio.to_thread(self._write_batch, batch)
        except OSError as error:
            for pending in batch:
                if not pending.done.done():
                    pending.done.set_exception(error)
            return
        for pending in batch:
            if not pending.done.done():
                pending.done.set_result(None)

    def _file(self, group: str) -> BinaryIO:
        handle = self._files.get(group)
        if handle is None:
            handle = open(self.directory / f"{group}.jsonl", "ab")  # noqa: SIM115
            self._files[group] = handle
        return handle

    def _take_unsynced(self) -> list[BinaryIO]:
        handles = [self._files[group] for group in self._unsynced]
        self._unsynced.clear()
        return handles

    @staticmethod
    def _fsync_files(handles: list[BinaryIO]) -> None:
        for handle in handles:
            os.fsync(handle.fileno())

    def _write_batch(self, batch: list[_Pending]) -> None:
        touched: dict[str, BinaryIO] = {}
        for pending in batch:
            handle = self._file(pending.group)
            handle.write(pending.line)
            touched[pending.group] = handle
        for handle in touched.values():
            handle.flush()
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
