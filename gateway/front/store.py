"""The tree store: group prefix trees, written ahead to disk (one JSON-lines log per group,
`STORE/<group>.jsonl`, in `trees/group_log.py`'s format), the recent ones in memory.
`CallRunner` applies a call's records inside a tree transaction and submits their lines
before it ends, so the tree never holds a call its log does not, and the reply's last byte
waits for the write. What a failed write, a damaged log, the `sync` modes and the memory
bound mean for a user: docs/api.md, "When the store's disk fills, or a log is damaged" and
"Memory over a long run".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undertow.gateway.errors import BadRequest, GatewayError, Unavailable
from undertow.gateway.front.held_lines import HeldLines
from undertow.gateway.metrics import GatewayMetrics
from undertow.gateway.trees.group_log import (
    LogLineError,
    ReplayReport,
    encode_event,
    replay_log,
)
from undertow.gateway.trees.tree import Tree

log = logging.getLogger(__name__)
SYNC_MODES = ("flush", "fsync")
FSYNC_INTERVAL_S = 1.0
HOLD_MAX_BYTES = 64 * 2**20
HOLD_MAX_S = 300.0
HOLD_RETRY_S = 0.5
GROUP_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class StoreUnavailable(Unavailable):
    """A log line could not be written: nothing of the call (or session event) was
    kept, and the scaffold gets a retryable 503 (529 from the Anthropic API)."""


class StoreDamaged(GatewayError, ValueError):
    """A log line, not the last, is damaged: the store cannot be replayed past it.
    `path` and `line` (1-based) name it; `undertow trees repair STORE` mends the store."""

    def __init__(self, path: Path, line: int, reason: str):
        super().__init__(f"{path} line {line} is damaged ({reason}); the gateway cannot "
                         f"replay its tree past it. Run `undertow trees repair "
                         f"{path.parent}` to keep every record that still replays and move "
                         "the others aside")
        self.path, self.line, self.reason = path, line, reason


class GroupSetAside(StoreUnavailable):
    """The group's log is damaged (`damage`): the store set the group aside at start-up
    and refuses its calls and events until the log is repaired and the gateway restarted."""

    def __init__(self, damage: StoreDamaged):
        super().__init__(f"group {damage.path.stem} is set aside: {damage}; then restart "
                         "the gateway")
        self.damage = damage


def check_group(group: object) -> str:
    if not isinstance(group, str) or not GROUP_PATTERN.match(group):
        raise BadRequest(f"group {group!r} must be 1-128 characters of letters, digits, '.', "
                         "'_' or '-', starting with a letter or digit", param="group")
    return group


@dataclass
class _GroupFile:
    """A group's log, open for appending; `size` is its length in bytes, all of it
    whole lines; `broken` is set when a failed write could not be cut off again."""

    fd: int
    size: int
    path: Path
    broken: str | None = None


@dataclass(frozen=True)
class GroupSummary:
    """What `GET /admin/groups` lists of a group; kept for a group whose tree was let go."""

    num_sessions: int
    num_calls: int
    num_unique_tokens: int

    @classmethod
    def of(cls, tree: Tree) -> GroupSummary:
        return cls(len(tree.sessions), len(tree.calls), tree.num_unique_tokens)


@dataclass
class _Waiter:
    """`fsync` mode: a submit waiting for the next fsync of its group's file."""

    group: str
    done: asyncio.Future = field(repr=False)


def _never_active(group: str) -> bool:
    return False


class TreeStore:
    """Trees by group, plus their write-ahead log under `directory`. `sync`: "flush" (a
    submit returns once the OS has the lines; files are fsync'ed in the background, at
    most `fsync_interval_s` after a write) or "fsync" (a submit's future also waits for
    one fsync round of every file written since the last: group commit). After a failed
    fsync the store refuses every write until the gateway restarts.

    Invariants: `trees` holds the trees in memory, least recently used first: every
    active group's, at most `max_idle_trees` idle ones (plus the one `tree` last loaded,
    until the next session closes or tree loads) or all of them when it is None; every
    other group of the store has a summary in `_summaries`. A group's file is open while
    its tree is in memory or its lines await an fsync. A group with held lines keeps its
    tree in memory. A group in `damaged` has no tree and takes no line."""

    def __init__(self, directory: Path, create: bool = True, sync: str = "flush",
                 fsync_interval_s: float = FSYNC_INTERVAL_S, max_idle_trees: int | None = None,
                 is_active: Callable[[str], bool] = _never_active,
                 metrics: GatewayMetrics | None = None, hold_max_bytes: int = HOLD_MAX_BYTES,
                 hold_max_s: float = HOLD_MAX_S):
        if sync not in SYNC_MODES:
            raise ValueError(f"sync={sync!r}: choose one of {SYNC_MODES}")
        if fsync_interval_s < 0:
            raise ValueError(f"fsync_interval_s={fsync_interval_s} must be >= 0")
        if max_idle_trees is not None and max_idle_trees < 0:
            raise ValueError(f"max_idle_trees={max_idle_trees} must be >= 0 (or None: no bound)")
        self.max_idle_trees, self.is_active = max_idle_trees, is_active
        self.metrics = metrics if metrics is not None else GatewayMetrics.create()
        self._held = HeldLines(hold_max_bytes, hold_max_s, self.metrics)
        self.sync = sync
        self.fsync_interval_s = fsync_interval_s
        self.directory = Path(directory)
        if create:
            self.directory.mkdir(parents=True, exist_ok=True)
        elif not self.directory.is_dir():
            raise FileNotFoundError(f"no tree store at {self.directory}")
        self.trees: OrderedDict[str, Tree] = OrderedDict()
        self._summaries: dict[str, GroupSummary] = {}  # the groups let go
        self.damaged: dict[str, StoreDamaged] = {}  # the groups set aside
        self._retrier: asyncio.Task | None = None
        self._replaying: str | None = None  # the group replay is applying events to
        self._files: dict[str, _GroupFile] = {}
        self._waiters: list[_Waiter] = []  # `fsync` mode: submits waiting for an fsync
        self._unsynced: set[str] = set()  # groups written since their last fsync
        self._syncing: set[str] = set()  # groups whose fds an fsync round is using
        self._failed: str | None = None  # `fsync` mode: why an fsync failed
        self._wakeup: asyncio.Event | None = None
        self._closing: asyncio.Event | None = None
        self._writer: asyncio.Task | None = None

    def tree(self, group: str) -> Tree:
        """The group's tree, now the most recently used: loaded back from its file if it
        was let go, new if the group has none. A group set aside (or whose file turns
        out damaged now) raises `GroupSetAside`."""
        tree = self.trees.get(group)
        if tree is not None:
            self.trees.move_to_end(group)
            return tree
        self._refuse_damaged(group)
        tree = self.trees[group] = Tree(check_group(group))
        if self._summaries.pop(group, None) is not None:
            try:
                for _ in self._replay_file(tree, self.directory / f"{group}.jsonl", False):
                    pass
            except StoreDamaged as damage:
                self._set_aside(group, damage)
                raise GroupSetAside(damage) from damage
            self.metrics.store_tree_loads.inc()
        self._let_go_idle(keep=group)
        return tree

    def _refuse_damaged(self, group: str) -> None:
        damage = self.damaged.get(group)
        if damage is not None:
            raise GroupSetAside(damage)

    def _set_aside(self, group: str, damage: StoreDamaged) -> None:
        """Takes a damaged group out of service; the others serve on."""
        self.trees.pop(group, None)
        self._summaries.pop(group, None)
        self.damaged[group] = damage
        self.metrics.store_damaged_groups.set(1, group=group)
        log.warning("tree store: %s. Group %s is set aside; the other groups serve", damage,
                    group)

    def has_group(self, group: str) -> bool:
        """Whether the store has the group, its tree in memory or not, or set aside."""
        return group in self.trees or group in self._summaries or group in self.damaged

    def groups(self) -> dict[str, GroupSummary]:
        """Every group of the store (in memory or not), by name."""
        return {**self._summaries, **{name: GroupSummary.of(tree)
                                      for name, tree in self.trees.items()}}

    def group_idle(self, group: str) -> None:
        """The group's last open session closed: lets go of idle trees past the bound."""
        self._let_go_idle()

    def replay(self, repair: bool = True) -> Iterator[dict[str, Any]]:
        """Rebuilds every tree from disk; yields every event (with its `group`) after
        applying it, so that a `call` event's call is the last of its tree's calls (its
        tree is in memory until the next event). `repair` cuts a torn last line off its
        file (readers pass False). A group with a damaged line is set aside (`damaged`)
        once the events before it were yielded. Idle trees past the bound are let go
        after each file. Lines without a checksum (written before lines had one) are
        accepted, and counted in one warning."""
        report = ReplayReport()
        for path in sorted(self.directory.glob("*.jsonl")):
            group = self._replaying = path.stem
            self._summaries.pop(group, None)
            self.trees[group] = tree = Tree(group)
            try:
                for event in self._replay_file(tree, path, repair, report):
                    event["group"] = group
                    yield event
            except StoreDamaged as damage:
                self._set_aside(group, damage)
            finally:
                self._replaying = None
            self._let_go_idle()
        if report.num_unchecked:
            log.warning("tree store: %d lines of %s carry no checksum (written before lines "
                        "had one): accepted unverified", report.num_unchecked, self.directory)

    @staticmethod
    def _replay_file(tree: Tree, path: Path, repair: bool,
                     report: ReplayReport | None = None) -> Iterator[dict[str, Any]]:
        """Applies one group's file to `tree`, yielding each event after applying it."""
        if not path.exists():  # its group was let go before its first line was written
            return
        try:
            for _, event in replay_log(tree, complete_lines(path, repair), report):
                yield event
        except LogLineError as error:
            raise StoreDamaged(path, error.line, error.reason) from error

    def _let_go_idle(self, keep: str | None = None) -> None:
        """Lets go of the least recently used idle trees past `max_idle_trees` (`keep`
        counts as idle if it is, but stays: its caller is about to use it)."""
        if self.max_idle_trees is not None:
            idle = [group for group in self.trees
                    if group != self._replaying and not self.is_active(group)]
            num_over = len(idle) - self.max_idle_trees
            for group in [group for group in idle
                          if group != keep and not self._held.has(group)][:max(0, num_over)]:
                self._summaries[group] = GroupSummary.of(self.trees.pop(group))
                self._close_file(group)
        self.metrics.store_trees_in_memory.set(len(self.trees))

    def _close_file(self, group: str) -> None:
        """Closes the file of a group let go, unless its lines await an fsync (the writer
        closes it after its round) or a failed write left it broken (it stays refused)."""
        group_file = self._files.get(group)
        if (group_file is None or group_file.broken is not None or group in self._unsynced
                or group in self._syncing or group in self.trees):
            return
        del self._files[group]
        os.close(group_file.fd)

    async def start(self) -> None:
        self._wakeup, self._closing = asyncio.Event(), asyncio.Event()
        self._writer = asyncio.create_task(self._sync_forever(self._wakeup, self._closing),
                                           name="tree-store-writer")
        self._retrier = asyncio.create_task(self._write_held_forever(self._closing),
                                            name="tree-store-held-lines")

    async def close(self) -> None:
        """Writes held lines if it can (drops them, telling their owners, if not), fsyncs
        whatever was written, then closes the files."""
        if self._writer is not None:
            assert self._closing is not None and self._wakeup is not None, "start() set them"
            self._closing.set()
            self._wakeup.set()
            tasks = [task for task in (self._writer, self._retrier) if task is not None]
            await asyncio.gather(*tasks, return_exceptions=True)
            self._writer = self._retrier = None
        self._write_held("the gateway closed before the disk took them")
        with contextlib.suppress(OSError):
            self._fsync_groups(self._take_unsynced())
        self._resolve(self._waiters, None)
        self._waiters = []
        for group_file in self._files.values():
            os.close(group_file.fd)
        self._files.clear()
        self._syncing.clear()

    def submit(self, group: str, *events: dict[str, Any],
               on_lost: Callable[[str], None] | None = None) -> asyncio.Future:
        """Writes the events' lines to the group's file now, in one piece, after any held
        lines of the group, so that lines keep the order of the calls to `submit`; raises
        `StoreUnavailable`, the file unchanged, when it cannot, unless `on_lost` is given
        and the lines fit the hold (`held_lines.py`): then they are held, and
        `on_lost(reason)` is called if they are dropped. The future resolves once the
        lines are as durable as the mode promises (at once for `flush`: the OS has them;
        at once for held lines: memory is all they have)."""
        if self._wakeup is None:
            raise RuntimeError("TreeStore.start() must run before submit()")
        if self._failed is not None:
            raise StoreUnavailable(f"the tree store stopped writing after an fsync failed "
                                   f"({self._failed}); restart the gateway")
        self._refuse_damaged(group)
        data = b"".join(encode_event(event) for event in events)
        done = asyncio.get_running_loop().create_future()
        try:
            self._held.write_in_order(group, functools.partial(self._write, group))
            self._write(group, data)
        except StoreUnavailable:
            if on_lost is None or not self._held.hold(group, data, on_lost):
                raise
            done.set_result(None)
            return done
        if self.sync == "flush":
            done.set_result(None)
        else:
            self._waiters.append(_Waiter(group, done))
        self._wakeup.set()
        return done

    def _write_held(self, give_up: str | None = None) -> None:
        """Writes every group's held lines the disk takes; drops those of a group whose
        oldest line waited `hold_max_s`, or (with `give_up`, the reason) of every group."""
        for group in self._held.groups():
            try:
                self._held.write_in_order(group, functools.partial(self._write, group))
            except StoreUnavailable as error:
                waited_s = self._held.waited_s(group)
                if give_up is not None or waited_s >= self._held.max_s:
                    self._drop_held(group, give_up or f"the disk refused them for "
                                    f"{waited_s:.1f} s ({error})",
                                    "the gateway closed" if give_up else
                                    "the disk refused it past store_hold_max_s")

    def _drop_held(self, group: str, reason: str, cause: str) -> None:
        """Drops a group's held lines (their owners are told) and reads its tree back
        from its file (the tree held their calls; the file is what replay will see)."""
        self._held.drop(group, reason, cause)
        if group in self.trees:
            tree = self.trees[group] = Tree(group)
            try:
                for _ in self._replay_file(tree, self.directory / f"{group}.jsonl", False):
                    pass
            except StoreDamaged as damage:
                self._set_aside(group, damage)

    async def _write_held_forever(self, closing: asyncio.Event) -> None:
        """Every `HOLD_RETRY_S`, writes the held lines the disk takes (see `_write_held`)."""
        while not closing.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing.wait(), HOLD_RETRY_S)
            if self._held.groups() and not closing.is_set():
                self._write_held()
                if self._wakeup is not None and self._unsynced:
                    self._wakeup.set()

    async def append(self, group: str, event: dict[str, Any]) -> None:
        """Writes one event line and waits until it is as durable as the mode promises."""
        await asyncio.shield(self.submit(group, event))

    def _write(self, group: str, data: bytes) -> None:
        """Appends whole lines, or nothing: a partial write is cut off again."""
        group_file = self._open(group)
        path = group_file.path
        if group_file.broken is not None:
            raise StoreUnavailable(f"{path} cannot be written ({group_file.broken}); restart "
                                   "the gateway once the disk is fixed")
        view, num_written = memoryview(data), 0
        try:
            while num_written < len(data):
                num_written += os.write(group_file.fd, view[num_written:])
        except OSError as error:
            if num_written:
                try:
                    os.ftruncate(group_file.fd, group_file.size)
                except OSError as cut_error:
                    group_file.broken = f"a torn line could not be cut off: {cut_error}"
            reason = error.strerror or str(error)
            raise StoreUnavailable(f"the tree store could not write {path} ({reason}); "
                                   "nothing of this was recorded, retry later") from error
        group_file.size += len(data)
        self._unsynced.add(group)

    def _open(self, group: str) -> _GroupFile:
        group_file = self._files.get(group)
        if group_file is None:
            path = self.directory / f"{group}.jsonl"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as error:
                raise StoreUnavailable(f"the tree store could not open {path} "
                                       f"({error.strerror or error}); retry later") from error
            group_file = self._files[group] = _GroupFile(fd, os.fstat(fd).st_size, path)
        return group_file

    async def _sync_forever(self, wakeup: asyncio.Event, closing: asyncio.Event) -> None:
        """Fsyncs the files written since the last round: at once in `fsync` mode (then
        resolves the submits that waited for it), at most `fsync_interval_s` after
        their first unsynced write in `flush` mode."""
        while not closing.is_set():
            await wakeup.wait()
            wakeup.clear()
            if not self._unsynced:
                continue
            if self.sync == "flush":
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(closing.wait(), self.fsync_interval_s)
            waiters, self._waiters = self._waiters, []
            try:
                await asyncio.to_thread(self._fsync_groups, self._take_unsynced())
            except OSError as error:
                self._fsync_failed(error, waiters)
                continue
            finally:
                synced, self._syncing = self._syncing, set()
                for group in synced:
                    self._close_file(group)
            self._resolve(waiters, None)

    def _fsync_failed(self, error: OSError, waiters: list[_Waiter]) -> None:
        if self.sync == "flush":
            log.error("tree store: fsync failed (%s); calls written since the last fsync are "
                      "safe from a gateway crash, not from a power loss", error)
            return
        self._failed = str(error)
        log.error("tree store: fsync failed (%s); no further call is recorded until the "
                  "gateway restarts", error)
        self._resolve(waiters, StoreUnavailable(
            f"the tree store could not fsync its log ({error}); retry later"))

    @staticmethod
    def _resolve(waiters: list[_Waiter], error: BaseException | None) -> None:
        for waiter in waiters:
            if not waiter.done.done():
                if error is None:
                    waiter.done.set_result(None)
                else:
                    waiter.done.set_exception(error)

    def _take_unsynced(self) -> list[int]:
        fds = [self._files[group].fd for group in self._unsynced]
        self._syncing |= self._unsynced
        self._unsynced.clear()
        return fds

    @staticmethod
    def _fsync_groups(fds: list[int]) -> None:
        for fd in fds:
            os.fsync(fd)


def complete_lines(path: Path, repair: bool) -> bytes:
    """A group file's bytes up to its last newline; with `repair`, a torn last line (no
    newline: the process died while writing it) is also cut off the file."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data) and repair:
        with open(path, "r+b") as handle:
            handle.truncate(end)
    return data[:end]
