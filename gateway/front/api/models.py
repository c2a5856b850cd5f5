"""`GET /v1/models`: the one model the gateway serves, in OpenAI's list shape."""

from __future__ import annotations

from aiohttp import web

from undertow.gateway.front.api.common import session_of
from undertow.gateway.front.config import GatewayConfig
from undertow.gateway.front.sessions import SessionRegistry


def add_routes(app: web.Application, sessions: SessionRegistry, config: GatewayConfig) -> None:
    async def list_models(request: web.Request) -> web.Response:
        session_of(request, sessions)
        return web.json_response({"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": 0, "owned_by": "undertow"}]})

    for prefix in ("", "/s/{session}"):
        app.router.add_get(f"{prefix}/v1/models", list_models)
