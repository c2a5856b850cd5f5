"""A group's write-ahead log as lines: the format `front/store.py` writes and the one
replay of it (the gateway's start-up, `undertow trees repair`, the learner's reader). One
JSON event per line (`session_open`, `call`: a `CallRecord`, `session_close`,
`session_expire`) in the order applied, so a replay rebuilds the same tree, node IDs
included. See docs/design.md, "Tree data model".
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from undertow.gateway.trees.errors import TreeError
from undertow.gateway.trees.tree import CallRecord, Tree

# The fields each kind of event must have; `"crc"`, the last field of every line, is the
# CRC-32 of the line's JSON without it (`encode_event`).
EVENT_FIELDS = {"session_open": ("session_id", "group", "key_sha256"),
                "call": ("call_id", "session_id", "anchor", "token_ids", "num_prompt",
                         "logprobs", "weight_versions"),
                "session_close": ("session_id", "reward"),
                "session_expire": ("session_id",)}
CHECKSUM_FIELD = b',"crc":'


class LogLineError(TreeError):
    """A log line replay cannot take: `line` (1-based) starting at byte `offset`, after
    `num_kept` events were applied; `reason` says what is wrong with it."""

    def __init__(self, line: int, offset: int, num_kept: int, reason: str):
        super().__init__(f"line {line}: {reason}")
        self.line, self.offset, self.num_kept, self.reason = line, offset, num_kept, reason


@dataclass
class ReplayReport:
    """What a replay met besides the events it applied: `num_unchecked` lines without a
    checksum (written before lines had one: accepted unverified), and with `skip_damaged`
    the lines it left out, as `LogLineError`s."""

    num_unchecked: int = 0
    skipped: list[LogLineError] = field(default_factory=list)


def encode_event(event: dict[str, Any]) -> bytes:
    """An event's log line: its JSON with its checksum as the last field, and a newline.
    orjson writes NaN as null: records keep non-finite numbers out (`Tree.add_call`)."""
    line = orjson.dumps(event)
    return b"%s%s%d}\n" % (line[:-1], CHECKSUM_FIELD, zlib.crc32(line))


def _checked(line: bytes, event: Any) -> bool:
    """Whether the line carries a checksum (then it has been verified: a mismatch raises
    `ValueError`); the field is taken out of `event`."""
    if not isinstance(event, dict) or "crc" not in event:
        return False
    crc = event.pop("crc")
    line = line.rstrip()
    suffix = b"%s%d}" % (CHECKSUM_FIELD, crc) if isinstance(crc, int) else b""
    if not suffix or not line.endswith(suffix) or zlib.crc32(
            line[:-len(suffix)] + b"}") != crc:
        raise ValueError("its checksum does not match: the line was changed after it was "
                         "written")
    return True


def apply_event(tree: Tree, event: dict[str, Any]) -> None:
    """Applies one logged event to its group's tree; a malformed one raises."""
    kind = event.get("kind") if isinstance(event, dict) else None
    if not isinstance(kind, str):
        raise ValueError("not a store event (no kind)")
    missing = [name for name in EVENT_FIELDS.get(kind, ()) if name not in event]
    if missing:
        raise ValueError(f"a {kind} event without {', '.join(missing)}")
    if kind == "call":
        tree.apply(CallRecord.from_json(event))
    elif kind == "session_close":
        tree.close_session(event["session_id"], event["reward"], event.get("meta"))
    elif kind == "session_expire":
        tree.expire_session(event["session_id"])


def _read_event(tree: Tree, line: bytes, report: ReplayReport, skipping: bool) -> dict:
    """Parses, verifies and applies one line; raises `ValueError`-likes on damage. After a
    skipped line, a call without a checksum and anchor path is refused: nothing shows
    that it still lands where it was recorded."""
    try:
        event = orjson.loads(line)
    except orjson.JSONDecodeError as error:
        raise ValueError(f"not JSON: {error}") from None
    if not _checked(line, event):
        report.num_unchecked += 1
        if skipping and isinstance(event, dict) and event.get("kind") == "call" and (
                event.get("anchor_path") is None):
            raise ValueError("a call without a checksum after a damaged line: it may hang "
                             "on what the damaged line held")
    apply_event(tree, event)
    return event


def replay_log(tree: Tree, data: bytes, report: ReplayReport | None = None,
               skip_damaged: bool = False) -> Iterator[tuple[int, dict[str, Any]]]:
    """Applies a group's log `data` to `tree`, line by line, yielding (1-based line,
    event) after each: the one replay of the gateway's store, its repair and the
    learner's reader. A torn last line (no newline: its writer died) is left out; a line
    that is not JSON, fails its checksum or does not fit the tree raises `LogLineError`,
    or with `skip_damaged` is left out (each line applied in a transaction, so a line
    left out changes nothing) and listed in `report`: later records that still land on
    their recorded paths are kept (`Tree.apply`)."""
    report = report if report is not None else ReplayReport()
    offset, num_kept = 0, 0
    for line_number, line in enumerate(data.split(b"\n")[:-1], start=1):
        if line.strip():
            try:
                with tree.transaction() if skip_damaged else contextlib.nullcontext():
                    event = _read_event(tree, line, report, bool(report.skipped))
            except (TreeError, KeyError, TypeError, ValueError, OverflowError) as error:
                damage = LogLineError(line_number, offset, num_kept, _reason(error))
                if not skip_damaged:
                    raise damage from error
                report.skipped.append(damage)
            else:
                num_kept += 1
                yield line_number, event
        offset += len(line) + 1


def _reason(error: BaseException) -> str:
    if isinstance(error, KeyError):
        return f"a record without {error}"
    return str(error) or type(error).__name__
