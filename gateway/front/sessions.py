"""Sessions: one scaffold run on one task, as the gateway knows it. Opened by the admin API
(the gateway makes the key) or by an unknown key's first call (`auto_sessions.py`); closed
with a reward, or expired without one; either way it refuses calls from then on. One that
met a failure of Undertow's own closes as an infra failure (`Session.close_meta`; docs/api.md,
"When Undertow fails a call").
"""

from __future__ import annotations

import bisect
import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from undertow.gateway.errors import BadRequest, NotFound, Unauthorized
from undertow.gateway.front.tokentruth import Head, InFlightCall

NUM_REMEMBERED_REPLIES = 4
# Distinct reasons a session keeps (counts of the others go to OTHER_REASON): a session
# that meets a thousand errors keeps a bounded record of them.
MAX_INFRA_REASONS = 16
OTHER_REASON = "other"
INFRA_CAUSE = "error:gateway"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Session:
    """Invariants: `key_sha256` never changes (the key itself is never kept); `closed`
    sessions refuse new calls. `heads` (token truth's `Head`s, newest last) are rebuilt
    from the store on restart (`head_replay.py`); the rest lives in memory only:
    `replies` by request fingerprint (an SDK's retry of a reply it never received is
    answered again, not recorded twice), `in_flight` (calls still generating, by
    fingerprint: a retry waits for its original), `calls_in_flight` (chat calls still
    generating, oldest first, labelled as heads), `known_messages` (by API: the last
    request's messages and body, so an API parses only what a request adds) and
    `infra_errors` (until the close, whose stored meta keeps them)."""

    session_id: str
    group: str
    key_sha256: str
    created_s: float
    meta: dict[str, Any] = field(default_factory=dict)
    heads: list[Head] = field(default_factory=list)
    replies: OrderedDict[str, Any] = field(default_factory=OrderedDict)
    in_flight: dict[str, Any] = field(default_factory=dict)
    calls_in_flight: list[InFlightCall] = field(default_factory=list)
    closed: bool = False
    reward: float | None = None
    num_calls: int = 0
    known_messages: dict[str, Any] = field(default_factory=dict)
    auto: bool = False
    last_used_s: float = field(default_factory=time.monotonic)
    expired: bool = False
    infra_errors: dict[str, int] = field(default_factory=dict)

    def note_infra_error(self, reason: str) -> None:
        """Counts a failure of Undertow's own that this session's scaffold met (`reason`,
        a few words: `"503 StoreUnavailable"`); the session closes as an infra failure."""
        if reason not in self.infra_errors and len(self.infra_errors) >= MAX_INFRA_REASONS:
            reason = OTHER_REASON
        self.infra_errors[reason] = self.infra_errors.get(reason, 0) + 1

    def close_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The meta the session is closed with: its closer's, and where Undertow failed
        it (`infra_errors`), `infra_failure: true` with the reasons. A closer that did
        not call it an infra failure keeps its cause as `scaffold_cause`, and the cause
        becomes `error:gateway` (the error that cause had was the gateway's)."""
        if not self.infra_errors:
            return dict(meta)
        reasons = ", ".join(f"{reason} x{n}" for reason, n in self.infra_errors.items())
        closed = {**meta, "infra_failure": True, "infra_errors": dict(self.infra_errors)}
        if not meta.get("infra_failure"):
            said = str(meta.get("error") or "")
            closed.update(cause=INFRA_CAUSE, scaffold_cause=meta.get("cause"),
                          error=f"Undertow failed this session: {reasons}"
                          + (f"; {said}" if said else ""))
        return closed

    def add_head(self, head: Head, num_heads: int) -> None:
        """Adds a head in the order its call started (`Head.started_s`: last, unless a
        call that started later has finished first), keeping the newest `num_heads`.
        Only heads that share the newest one's messages keep them (older ones are matched
        by their keys), and only the newest keeps its IDs (as a `TokenPath` and as JSON),
        so a session holds about one copy of its history however many heads it has."""
        self.heads.insert(bisect.bisect_right(self.heads, head.started_s,
                                              key=lambda h: h.started_s), head)
        del self.heads[:-num_heads]
        newest = self.heads[-1]
        for index, old in enumerate(self.heads[:-1]):
            if (old.token_ids_json is not None or old.token_ids is not None
                    or (old.messages is not None and old.messages is not newest.messages)):
                keep = old.messages if old.messages is newest.messages else None
                self.heads[index] = replace(old, messages=keep, token_ids_json=None,
                                            token_ids=None)

    def remember_reply(self, fingerprint: str, reply: Any) -> None:
        self.replies[fingerprint] = reply
        while len(self.replies) > NUM_REMEMBERED_REPLIES:
            self.replies.popitem(last=False)

    def summary(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "group": self.group, "closed": self.closed,
                "reward": self.reward, "num_calls": self.num_calls, "meta": self.meta,
                "created_s": self.created_s, "auto": self.auto,
                "infra_errors": dict(self.infra_errors)}


class SessionRegistry:
    """Sessions by ID and by key hash, and the number of open ones in each group (a group
    with none is idle: `on_group_idle(group)` is called when its last one closes, so the
    tree store can let its tree go)."""

    def __init__(self, num_heads: int = 16,
                 on_group_idle: Callable[[str], None] | None = None):
        self.num_heads = num_heads
        self.on_group_idle = on_group_idle
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self._num_open = 0  # counted as sessions are added and closed, not by a scan
        self._num_open_by_group: dict[str, int] = {}  # groups with an open session only

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def num_open(self) -> int:
        return self._num_open

    def has_open(self, group: str) -> bool:
        """Whether the group has an open session (it is active, not idle)."""
        return group in self._num_open_by_group

    def create(self, group: str, session_id: str | None = None,
               meta: dict[str, Any] | None = None) -> tuple[Session, str]:
        """A new session and its key (returned once, never stored); not yet added: the
        caller writes its open event to the store first, then `add`s it."""
        key = f"sk-undertow-{secrets.token_urlsafe(24)}"
        return self.new_session(group, key, session_id, meta), key

    def new_session(self, group: str, key: str, session_id: str | None = None,
                    meta: dict[str, Any] | None = None, auto: bool = False,
                    reopens: Session | None = None) -> Session:
        """A session for `key`, not yet added (the caller stores its open event first).
        A key already in use is refused, unless it is the key of `reopens`, a closed
        session that the new one takes the key over from."""
        session_id = session_id or f"s-{secrets.token_hex(8)}"
        if not isinstance(session_id, str) or not session_id.replace("-", "").replace(
                "_", "").isalnum() or len(session_id) > 128:
            raise BadRequest(f"session_id {session_id!r} must be 1-128 letters, digits, '-' "
                             "or '_'", param="session_id")
        if session_id in self._by_id:
            raise BadRequest(f"session {session_id} exists; pick another ID or omit it",
                             param="session_id")
        current = self._by_key.get(hash_key(key))
        if current is not None and not (current is reopens and current.closed):
            raise BadRequest("this key already belongs to a session")
        return Session(session_id, group, hash_key(key), time.time(), dict(meta or {}),
                       auto=auto)

    def add(self, session: Session) -> None:
        """Registers a session; its key names it unless the key names a newer session
        (a reopened key: replay reads groups' files in name order, not in time order)."""
        self._by_id[session.session_id] = session
        current = self._by_key.get(session.key_sha256)
        if current is None or current.created_s <= session.created_s:
            self._by_key[session.key_sha256] = session
        if not session.closed:
            self._num_open += 1
            self._num_open_by_group[session.group] = (
                self._num_open_by_group.get(session.group, 0) + 1)

    def close(self, session: Session, reward: float | None = None) -> None:
        """Marks `session` closed (it refuses calls from now on) and lets go of what only a
        next call would use: its heads (which hold its history's IDs), the replies kept for
        SDK retries and its last request's messages. A run of many sessions keeps only
        their summaries in memory, not every history. Closing a group's last open session
        calls `on_group_idle` (once the session is marked closed)."""
        was_open = not session.closed
        session.closed, session.reward = True, reward
        session.heads.clear()
        session.replies.clear()
        session.known_messages.clear()
        if was_open:
            self._num_open -= 1
            self._num_open_by_group[session.group] -= 1
            if not self._num_open_by_group[session.group]:
                del self._num_open_by_group[session.group]
                if self.on_group_idle is not None:
                    self.on_group_idle(session.group)

    def expire(self, session: Session) -> None:
        """Closes `session` without a reward because it idled (`auto_sessions.py`)."""
        self.close(session)
        session.expired = True

    def restore(self, event: dict[str, Any]) -> None:
        """Applies a stored session event (on replay)."""
        if event["kind"] == "session_open":
            self.add(Session(event["session_id"], event["group"], event["key_sha256"],
                             event.get("created_s", 0.0), dict(event.get("meta") or {}),
                             auto=bool(event.get("auto"))))
        elif event["kind"] == "session_close" and event["session_id"] in self._by_id:
            self.close(self._by_id[event["session_id"]], event["reward"])
        elif event["kind"] == "session_expire" and event["session_id"] in self._by_id:
            self.expire(self._by_id[event["session_id"]])

    def of_key(self, key: str) -> Session | None:
        """The newest session of `key`, open or closed; None for a key never seen."""
        return self._by_key.get(hash_key(key))

    def touch(self, key: str) -> None:
        """Marks the session of `key` (if any) as used now."""
        session = self._by_key.get(hash_key(key))
        if session is not None:
            session.last_used_s = time.monotonic()

    def find(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    def get(self, session_id: str) -> Session:
        session = self._by_id.get(session_id)
        if session is None:
            raise NotFound(f"session {session_id} does not exist; open one through the admin "
                           "API (POST /admin/sessions)")
        return session

    def authenticate(self, session_id: str | None, key: str | None) -> Session:
        """The session a request reaches: by path ID (and then its key must match) or
        by key alone. Any mismatch is the same 401, so keys cannot be probed."""
        if not key:
            raise Unauthorized("no API key: send the session key as 'Authorization: Bearer "
                               "KEY' or 'x-api-key: KEY'")
        session = self._by_key.get(hash_key(key))
        if session is None or (session_id is not None and session.session_id != session_id):
            raise Unauthorized("invalid API key for this session: use the key returned when "
                               "the session was opened")
        if session.closed:
            raise Unauthorized(_closed_message(session))
        session.last_used_s = time.monotonic()
        return session

    def sessions(self, group: str | None = None) -> list[Session]:
        return [session for session in self._by_id.values()
                if group is None or session.group == group]

    @staticmethod
    def open_event(session: Session) -> dict[str, Any]:
        event = {"kind": "session_open", "session_id": session.session_id,
                 "group": session.group, "key_sha256": session.key_sha256,
                 "created_s": session.created_s, "meta": session.meta}
        return {**event, "auto": True} if session.auto else event

    @staticmethod
    def expire_event(session: Session) -> dict[str, Any]:
        """The event of a session closed without a reward (`restore` reads it back)."""
        return {"kind": "session_expire", "session_id": session.session_id}


def _closed_message(session: Session) -> str:
    if not session.auto:
        return f"session {session.session_id} is closed; open a new session"
    return (f"session {session.session_id}, which this API key opened, is closed "
            f"({closed_how(session)}); a closed session takes no more calls: use a different "
            "API key to start a new session")


def closed_how(session: Session) -> str:
    """How a closed session ended, in words."""
    if session.expired:
        return "it was idle too long and closed without a reward" + (
            "" if session.reward is None else f", since scored {session.reward:g}")
    return ("it was closed without a reward" if session.reward is None
            else f"it was closed with reward {session.reward:g}")
