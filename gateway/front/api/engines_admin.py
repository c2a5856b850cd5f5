"""Operator endpoints for the engine pool, behind the admin token, mounted by the app factory
with `add_engine_routes(app, pool, admin_auth)`; `admin_auth(request)` raises an aiohttp
HTTP exception (401/403) when the request may not pass. The endpoints: docs/api.md, "The
operator's endpoints".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from undertow.gateway.engine_pool.pool import (
    PAUSE_MODES,
    EnginePool,
    PoolUnavailable,
    UnknownEngine,
)
from undertow.gateway.engines.protocol import IncompatibleCheckpoint

AdminAuth = Callable[[web.Request], None]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}},
                             status=status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as error:
        raise web.HTTPBadRequest(text=f"body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="body must be a JSON object")
    return body


def _guarded(admin_auth: AdminAuth, handler: Handler) -> Handler:
    async def guarded(request: web.Request) -> web.StreamResponse:
        admin_auth(request)
        try:
            return await handler(request)
        except UnknownEngine as error:
            return _error(404, str(error.args[0]))
        except web.HTTPBadRequest as error:
            return _error(400, error.text or "bad request")
        except ValueError as error:
            return _error(400, str(error))
    return guarded


class _EngineHandlers:
    """The handlers, bound to one pool."""

    def __init__(self, pool: EnginePool):
        self.pool = pool

    async def list_engines(self, request: web.Request) -> web.Response:
        return web.json_response({"engines": self.pool.describe(), "paused": self.pool.paused})

    async def add_engine(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        url = body.get("url")
        if not isinstance(url, str) or "://" not in url:
            return _error(400, "give the engine's base URL as {\"url\": \"http://host:port\"} "
                               "(or KIND+http://host:port, e.g. vllm+http://host:port)")
        try:
            engine = await self.pool.add_engine(url)
        except ValueError as error:
            return _error(400, str(error))
        except PoolUnavailable as error:
            return _error(502, str(error))
        return web.json_response(engine.describe(self.pool.router.num_pinned(engine.engine_id)),
                                 status=201)

    async def drain_engine(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        migrate = body.get("migrate", False)
        if not isinstance(migrate, bool):
            return _error(400, "migrate must be true or false")
        engine = await self.pool.drain_engine(request.match_info["engine_id"], migrate=migrate)
        return web.json_response(engine.describe(self.pool.router.num_pinned(engine.engine_id)))

    async def remove_engine(self, request: web.Request) -> web.Response:
        migrate = request.query.get("migrate", "true").lower()
        if migrate not in ("true", "false"):
            return _error(400, "migrate must be true or false")
        engine_id = request.match_info["engine_id"]
        await self.pool.remove_engine(engine_id, migrate=migrate == "true")
        return web.json_response({"removed": engine_id})

    async def pause(self, request: web.Request) -> web.Response:
        mode = (await _json_body(request)).get("mode", "drain")
        if mode not in PAUSE_MODES:
            return _error(400, f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        await self.pool.pause(mode)
        return web.json_response({"paused": True, "mode": mode})

    async def resume(self, request: web.Request) -> web.Response:
        await self.pool.resume()
        return web.json_response({"paused": False})

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        model_path, version = body.get("model_path"), body.get("weight_version")
        mode = body.get("mode", "drain")
        if not isinstance(model_path, str) or not model_path:
            return _error(400, "give model_path, a model directory every engine can read")
        if not isinstance(version, int | str) or isinstance(version, bool):
            return _error(400, "give weight_version, the step that produced the weights")
        if mode not in PAUSE_MODES:
            return _error(400, f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        try:
            result = await self.pool.update_weights(model_path, version, mode)
        except IncompatibleCheckpoint as error:
            return _error(400, error.message)
        return web.json_response(result, status=200 if not result["failed"] else 502)


def add_engine_routes(app: web.Application, pool: EnginePool, admin_auth: AdminAuth) -> None:
    """Mounts the operator's engine endpoints on the app."""
    handlers = _EngineHandlers(pool)
    routes = [
        ("GET", "/admin/engines", handlers.list_engines),
        ("POST", "/admin/engines", handlers.add_engine),
        ("POST", "/admin/engines/{engine_id}/drain", handlers.drain_engine),
        ("DELETE", "/admin/engines/{engine_id}", handlers.remove_engine),
        ("POST", "/admin/pause", handlers.pause),
        ("POST", "/admin/resume", handlers.resume),
        ("POST", "/admin/update_weights", handlers.update_weights),
    ]
    for method, path, handler in routes:
        app.router.add_route(method, path, _guarded(admin_auth, handler))
