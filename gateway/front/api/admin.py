"""Operator endpoints for sessions and trees, behind the admin token; the engines' are in
`engines_admin.py`. The endpoints: docs/api.md, "The operator's endpoints".
"""

from __future__ import annotations

import hmac
import math
from typing import Any

from aiohttp import web

from undertow.gateway.engine_pool.pool import EnginePool
from undertow.gateway.errors import BadRequest, NotFound
from undertow.gateway.front.sessions import SessionRegistry
from undertow.gateway.front.store import TreeStore, check_group
from undertow.gateway.metrics import GatewayMetrics
from undertow.gateway.trees.tree import tree_to_json


def make_admin_auth(token: str):
    """The check every admin route runs: raises 401 unless the bearer is the token."""
    def admin_auth(request: web.Request) -> None:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not token or not hmac.compare_digest(given.encode(), token.encode()):
            raise web.HTTPUnauthorized(
                text='{"error": {"message": "admin token missing or wrong (Authorization: '
                     'Bearer TOKEN, the UNDERTOW_ADMIN_TOKEN of the gateway)", '
                     '"type": "invalid_request_error"}}', content_type="application/json")
    return admin_auth


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as error:
        raise BadRequest(f"the body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


class _SessionHandlers:
    def __init__(self, sessions: SessionRegistry, store: TreeStore, pool: EnginePool,
                 metrics: GatewayMetrics) -> None:
        self.sessions, self.store, self.pool, self.metrics = sessions, store, pool, metrics

    async def open(self, request: web.Request) -> web.Response:
        body = await _body(request)
        group = check_group(body.get("group"))
        meta = body.get("meta") or body.get("metadata") or {}
        session, key = self.sessions.create(group, body.get("session_id"), meta)
        self.store.tree(group)
        await self.store.append(group, SessionRegistry.open_event(session))  # written ahead
        self.sessions.add(session)
        self.metrics.open_sessions.set(self.sessions.num_open)
        base = f"{request.scheme}://{request.host}/s/{session.session_id}/v1"
        return web.json_response({"session_id": session.session_id, "api_key": key,
                                  "group": group, "base_url": base}, status=201)

    async def list(self, request: web.Request) -> web.Response:
        group = request.query.get("group")
        return web.json_response({"sessions": [s.summary()
                                               for s in self.sessions.sessions(group)]})

    async def show(self, request: web.Request) -> web.Response:
        return web.json_response(self.sessions.get(request.match_info["session_id"]).summary())

    async def close(self, request: web.Request) -> web.Response:
        session = self.sessions.get(request.match_info["session_id"])
        body = await _body(request)
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(
                reward):
            raise BadRequest(f"reward must be a finite number, got {reward!r}", param="reward")
        meta = session.close_meta(body.get("meta") or body.get("metadata") or {})
        await self.store.append(session.group, {"kind": "session_close",  # written ahead
                                                "session_id": session.session_id,
                                                "reward": float(reward), "meta": meta})
        self.store.tree(session.group).close_session(session.session_id, reward, meta)
        self.sessions.close(session, float(reward))
        session.meta.update(meta)
        await self.pool.close_session(session.session_id)
        self.metrics.open_sessions.set(self.sessions.num_open)
        self.metrics.closed_sessions.inc(
            cause=str(meta.get("cause", "unknown"))[:64],
            infra_failure="true" if meta.get("infra_failure") else "false")
        return web.json_response(session.summary())

    async def session_tree(self, request: web.Request) -> web.Response:
        session = self.sessions.get(request.match_info["session_id"])
        return web.json_response(tree_to_json(self.store.tree(session.group),
                                              session.session_id))

    async def groups(self, request: web.Request) -> web.Response:
        return web.json_response({"groups": [
            {"group": name, "num_sessions": summary.num_sessions,
             "num_calls": summary.num_calls, "num_unique_tokens": summary.num_unique_tokens}
            for name, summary in sorted(self.store.groups().items())]})

    async def group_tree(self, request: web.Request) -> web.Response:
        group = request.match_info["group"]
        if not self.store.has_group(group):
            raise NotFound(f"group {group} has no tree; list groups with GET /admin/groups")
        return web.json_response(tree_to_json(self.store.tree(group)))


def add_routes(app: web.Application, sessions: SessionRegistry, store: TreeStore,
               pool: EnginePool, metrics: GatewayMetrics, admin_auth) -> None:
    handlers = _SessionHandlers(sessions, store, pool, metrics)
    routes = [("POST", "/admin/sessions", handlers.open),
              ("GET", "/admin/sessions", handlers.list),
              ("GET", "/admin/sessions/{session_id}", handlers.show),
              ("POST", "/admin/sessions/{session_id}/close", handlers.close),
              ("GET", "/admin/sessions/{session_id}/tree", handlers.session_tree),
              ("GET", "/admin/groups", handlers.groups),
              ("GET", "/admin/groups/{group}/tree", handlers.group_tree)]
    for method, path, handler in routes:
        app.router.add_route(method, path, _guarded(admin_auth, handler))


def _guarded(admin_auth, handler):
    async def guarded(request: web.Request) -> web.StreamResponse:
        admin_auth(request)
        return await handler(request)
    return guarded
