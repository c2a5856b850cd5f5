"""Auto-sessions: any API key a client presents opens its own session on first use, so an
unmodified tool (Claude Code, Codex, a person's own agent) needs only the gateway's base URL
and any key; idle ones expire without a reward. Created by `app.create_app` when
`GatewayConfig.auto_sessions` is set; what a user sees: the README, "Use it with your agent".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from undertow.gateway.errors import Unauthorized
from undertow.gateway.front.api.common import request_key
from undertow.gateway.front.config import AutoSessionsConfig
from undertow.gateway.front.sessions import Session, SessionRegistry, closed_how
from undertow.gateway.front.store import TreeStore
from undertow.gateway.metrics import Counter, GatewayMetrics, Gauge

log = logging.getLogger(__name__)
OPENED_BY = "auto-sessions"


@dataclass(frozen=True)
class AutoSessionMetrics:
    """What `/metrics` says of auto-sessions (registered only when they are on)."""

    enabled: Gauge
    opened: Counter
    reopened: Counter
    expired: Counter

    @classmethod
    def create(cls, metrics: GatewayMetrics) -> AutoSessionMetrics:
        r = metrics.registry
        return cls(
            enabled=r.gauge("undertow_auto_sessions_enabled",
                            "1 when unknown API keys open sessions (in this group).",
                            ("group",)),
            opened=r.counter("undertow_auto_sessions_opened_total",
                             "Sessions opened by a new API key's first call."),
            reopened=r.counter("undertow_auto_sessions_reopened_total",
                               "Sessions opened by the key of a closed auto session "
                               "(auto_sessions.reopen)."),
            expired=r.counter("undertow_auto_sessions_expired_total",
                              "Auto sessions closed without a reward after idling."))


class AutoSessions:
    """Opens a session per unknown key (`middleware`, on bare `/v1/...` routes only: a
    `/s/{session}/...` route names its session) and expires idle ones (`run`)."""

    def __init__(self, config: AutoSessionsConfig, sessions: SessionRegistry,
                 store: TreeStore, pool, metrics: GatewayMetrics):
        self.config = config
        self.sessions, self.store, self.pool, self.metrics = sessions, store, pool, metrics
        self.counts = AutoSessionMetrics.create(metrics)
        self.counts.enabled.set(1, group=config.group)
        self._opening = asyncio.Lock()

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        key = request_key(request)
        if not key or not request.path.startswith("/v1/"):
            return await handler(request)
        session = self.sessions.of_key(key)
        if session is None or self._reopens(session):
            await self.open(key, request.headers.get("User-Agent", ""))
        elif session.closed and session.auto:
            raise Unauthorized(self.refusal(session))
        try:
            return await handler(request)
        finally:  # idle time counts from a call's end: a long call is not idleness
            self.sessions.touch(key)

    def _reopens(self, session: Session) -> bool:
        return session.closed and session.auto and self.config.reopens(session.expired)

    async def open(self, key: str, user_agent: str = "") -> Session:
        """The session of `key`: opened now for a new key, or for one whose closed
        session may be reopened (a new session of its group); else the one it has.
        Openings run one at a time and a session is registered only once its open event
        is in the store, so two requests with one new key make one session and no call
        is written ahead of its session's opening."""
        async with self._opening:
            old = self.sessions.of_key(key)
            if old is not None and not self._reopens(old):
                return old
            meta = {"opened_by": OPENED_BY, "user_agent": user_agent[:200],
                    **({"reopens": old.session_id} if old is not None else {})}
            group = old.group if old is not None else self.config.group
            session = self.sessions.new_session(group, key, meta=meta, auto=True, reopens=old)
            self.store.tree(session.group)
            await self.store.append(session.group, SessionRegistry.open_event(session))
            self.sessions.add(session)
        self.counts.opened.inc()
        self.metrics.open_sessions.set(self.sessions.num_open)
        if old is None:
            log.info("auto-sessions: opened %s in group %s", session.session_id, session.group)
        else:
            self.counts.reopened.inc()
            log.info("auto-sessions: the key of %s (%s) opened %s in group %s",
                     old.session_id, closed_how(old), session.session_id, session.group)
        return session

    def refusal(self, session: Session) -> str:
        """The 401 for the key of a closed auto session that is not reopened: what
        happened and what to do."""
        reopened = {"never": "no closed session's key",
                    "expired": "only the keys of sessions that expired for idleness",
                    "closed": "every closed session's key"}[self.config.reopen]
        setting = "expired" if session.expired else "closed"
        return (f"session {session.session_id}, which this API key opened, is closed "
                f"({closed_how(session)}); this gateway reopens {reopened} "
                f"(auto_sessions.reopen: {self.config.reopen}). Use a different API key to "
                "start a new session, or start the gateway with auto_sessions.reopen: "
                f"{setting} to reopen this key as a new session")

    def idle(self, now_s: float) -> list[Session]:
        """Open auto sessions with no call in flight and none for `idle_close_s`."""
        return [session for session in self.sessions.sessions(self.config.group)
                if session.auto and not session.closed and not session.in_flight
                and now_s - session.last_used_s >= self.config.idle_close_s]

    async def expire_idle(self, now_s: float | None = None) -> list[str]:
        """Closes the idle auto sessions without a reward (not trained on until an
        operator closes them with one: `undertow session close ID --reward R`); returns
        their IDs."""
        expired = []
        for session in self.idle(time.monotonic() if now_s is None else now_s):
            await self.store.append(session.group, SessionRegistry.expire_event(session))
            self.store.tree(session.group).expire_session(session.session_id)
            self.sessions.expire(session)
            await self.pool.close_session(session.session_id)
            self.counts.expired.inc()
            expired.append(session.session_id)
        if expired:
            self.metrics.open_sessions.set(self.sessions.num_open)
            log.info("auto-sessions: %s idle, closed without a reward", ", ".join(expired))
        return expired

    async def run(self) -> None:
        """Expires idle sessions every `check_interval_s`, until cancelled."""
        while True:
            await asyncio.sleep(self.config.check_interval_s)
            try:
                await self.expire_idle()
            except Exception:  # one failed round must not end the checks
                log.exception("auto-sessions: the idle check failed")

    async def checks(self, app: web.Application):
        """The app's cleanup context: the idle checks run while the app does."""
        task = asyncio.create_task(self.run(), name="auto-sessions-idle")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
