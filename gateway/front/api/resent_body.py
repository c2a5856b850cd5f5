"""A request body that re-sends the previous one's history, parsed only where it is new.
A scaffold re-sends its whole history on every call: at a million tokens a chat body is
megabytes of JSON of which the last kilobytes are new, and parsing it whole was the largest
cost of a call that grew with the history (benchmarks/README.md, xLong horizon (d)). A
session keeps its last body (`KnownBody`); `parse_resent` parses and hashes the next one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

__all__ = ["KnownBody", "parse_resent"]

MARKER = {"\x00undertow": "end of history"}  # an element no scaffold sends
_MARKER_CLOSE = b"," + orjson.dumps(MARKER) + b"]}"
MAX_CANDIDATES = 16  # `]`s tried from a body's end for where its array ends
WHITESPACE = b" \t\r\n"


@dataclass(frozen=True)
class KnownBody:
    """A body parsed before. Invariants: when `end` is set, `raw[:end]` ends with the
    last element (an object) of the array `key` names, and only whitespace and its `]`
    follow (proved when `before` is set: the fields before the array, as those bytes
    parse); `after` is the fields after the array; `items` is the array's parsed
    elements (shared with the next body's, never changed); `digest` is the XXH3-128 of
    `raw`, `prefix_hash` the hash of `raw[:end]` (never updated in place: copied)."""

    raw: bytes
    key: str
    end: int | None
    items: list
    after: dict
    digest: str
    prefix_hash: Any = None
    before: dict | None = None


def parse_resent(raw: bytes, known: KnownBody | None, key: str = "messages", *,
                 whole: Callable[[bytes], Any] = orjson.loads,
                 loads: Callable[[bytes], Any] = orjson.loads,
                 hasher: Callable[[], Any] = xxhash.xxh3_128) -> tuple[Any, KnownBody | None]:
    """What `whole(raw)` gives, parsing only what follows `known`'s history where `raw`
    re-sends it (`_splice`); and what the next body of the session may reuse. `whole`
    parses a body that cannot be spliced (and raises what it raises for one that is not
    JSON); `loads` parses the pieces (JSON errors are `ValueError`s); `hasher` makes the
    streaming hash behind `KnownBody.digest` (the retry fingerprint,
    `common.fingerprint`): the hash of the bytes up to the history's end is carried from
    body to body, so a body costs the hash its new bytes. The price: a session holds its
    last body's bytes (3.5 MB at a million tokens) besides its parsed messages."""
    if known is not None and known.key == key and known.end is not None:
        spliced = _splice(raw, known, loads)
        if spliced is not None:
            body, end, after, before = spliced
            prefix_hash = _extended(known.prefix_hash, raw, known.end, end)
            return body, KnownBody(raw, key, end, body[key], after,
                                   _digest(prefix_hash, raw, end, hasher), prefix_hash, before)
    body = whole(raw)
    if not isinstance(body, dict) or not isinstance(body.get(key), list):
        return body, None
    end, after = _find_end(raw, body, key, loads)
    prefix_hash = _extended(hasher(), raw, 0, end)
    return body, KnownBody(raw, key, end, body[key], after,
                           _digest(prefix_hash, raw, end, hasher), prefix_hash)


def _extended(prefix_hash, raw: bytes, start: int, end: int | None):
    """`prefix_hash` (of `raw[:start]`) extended to `raw[:end]`: a new hash (None if
    `end` is)."""
    if end is None:
        return None
    extended = prefix_hash.copy()
    extended.update(memoryview(raw)[start:end])
    return extended


def _digest(prefix_hash, raw: bytes, end: int | None, hasher) -> str:
    """The hex digest of all of `raw`, from `prefix_hash` (of `raw[:end]`) when there is one."""
    whole = hasher() if prefix_hash is None else prefix_hash.copy()
    whole.update(memoryview(raw)[0 if prefix_hash is None else end:])
    return whole.hexdigest()


def _splice(raw: bytes, known: KnownBody, loads
            ) -> tuple[dict, int | None, dict, dict] | None:
    """The body, where its history ends, the fields after and before the array; None
    where `raw` does not extend `known` (then it is parsed whole). When `raw` has
    `known`'s bytes up to its history's end (one `memcmp`), only the rest is parsed, in
    two pieces split at the `]` that closes the array: `b"[{}" + rest[:split] + b"]"`,
    the new messages (`{}` leaves the parser where the known last message, an object,
    did, so this parses exactly when they are whole elements), and the fields after the
    array (`_fields_after`; not parsed again when they are the known body's bytes). The
    body is the known fields before the array, the known messages (the same objects:
    comparing them with the previous call's is pointer equality), the new ones and the
    fields after: what `orjson.loads` gives for the whole body, since JSON reads the
    same from the same state."""
    end = known.end
    if end is None or not raw.startswith(memoryview(known.raw)[:end]):
        return None
    before = known.before if known.before is not None else _proved_before(known, loads)
    if before is None:
        return None
    rest = raw[end:]
    fields = memoryview(known.raw)[known.raw.index(b"]", end):]  # `]` and the fields after
    if rest.endswith(fields):  # the fields after the array are unchanged
        split, after = len(rest) - len(fields), known.after
    else:
        split, after = _split_rest(rest, known.key, loads)
        if split is None:
            return None
    items = _new_items(rest[:split], loads)
    if items is None:
        return None
    body = {**before, known.key: known.items + items, **after}
    return body, _past_object(raw, end + split), after, before


def _proved_before(known: KnownBody, loads) -> dict | None:
    """The fields before `known`'s array if `known.end` is proved to be its end, else
    None. The proof, once, the first time a later body shares the bytes before it: those
    bytes, closed by a marker element, `]` and `}`, parse only if they end inside the
    array that `key` names with its last element whole (inside a string, a deeper value
    or another array they do not, or the marker lands elsewhere)."""
    try:
        prefix = loads(b"".join((memoryview(known.raw)[:known.end], _MARKER_CLOSE)))
    except ValueError:
        return None
    if not isinstance(prefix, dict):
        return None
    items = prefix.pop(known.key, None)
    if not (isinstance(items, list) and items and items[-1] == MARKER
            and items[:-1] == known.items):
        return None
    return prefix


def _find_end(raw: bytes, body: dict, key: str, loads) -> tuple[int | None, dict]:
    """Where `body[key]`'s last element ends in `raw` (not yet proved), and the fields
    after the array: the last `]` after an object from which the rest parses to exactly
    `body`'s fields after `key`."""
    keys = list(body)
    expected = {name: body[name] for name in keys[keys.index(key) + 1:]}
    stop = len(raw)
    for _ in range(MAX_CANDIDATES):
        end = raw.rfind(b"]", 0, stop)
        if end < 0:
            break
        past = _past_object(raw, end)
        if past is not None:
            after = _fields_after(raw[end:], loads)
            if after is not None and after == expected and list(after) == list(expected):
                return past, after
        stop = end
    return None, {}


def _split_rest(rest: bytes, key: str, loads) -> tuple[int | None, dict]:
    """Where the new messages end in `rest` (the bytes after the known history) when the
    fields after them changed: the last `]` after an object from which the rest parses
    as fields without `key` and before which whole elements stand, or None. (Only one
    `]` can be both: a `]` after whole elements closes the array.)"""
    stop = len(rest)
    for _ in range(MAX_CANDIDATES):
        split = rest.rfind(b"]", 0, stop)
        if split < 0:
            break
        if _past_object(rest, split) is not None:
            after = _fields_after(rest[split:], loads)
            if (after is not None and key not in after
                    and _new_items(rest[:split], loads) is not None):
                return split, after
        stop = split
    return None, {}


def _past_object(raw: bytes, bracket: int) -> int | None:
    """The offset just past the `}` that `raw[bracket]` follows (past whitespace), or
    None if it follows something else."""
    index = bracket - 1
    while index >= 0 and raw[index] in WHITESPACE:
        index -= 1
    return index + 1 if index >= 0 and raw[index] == ord("}") else None


def _fields_after(tail: bytes, loads) -> dict | None:
    """The fields in `tail` (from an array's `]` to the end of its object): `],` and
    the members become `{` and the members, `]}` becomes `{}`; None if that is no JSON
    object (then the whole body is none either)."""
    rest = tail[1:].lstrip(WHITESPACE)
    if rest.startswith(b","):
        rest = rest[1:]
        if not rest.lstrip(WHITESPACE).startswith(b'"'):
            return None
    elif not rest.startswith(b"}"):
        return None
    try:
        fields = loads(b"{" + rest)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) else None


def _new_items(items: bytes, loads) -> list | None:
    """The elements in `items` (what follows an array's last known element), or None
    if they are not whole elements."""
    try:
        parsed = loads(b"[{}" + items + b"]")
    except ValueError:
        return None
    return parsed[1:]
