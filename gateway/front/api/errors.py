"""Error bodies in each API's own shape, the one its SDKs parse: `error_middleware` turns
every `GatewayError` (anything unexpected as a 500) into the route's family's body, with
`Retry-After` on a 429, and notes an error reply of Undertow's own on its session
(`note_infra_error`; docs/api.md, "When Undertow fails a call").

    OpenAI (chat, completions, responses, models): {"error": {"message", "type", "param", "code"}}
    Anthropic (messages): {"type": "error", "error": {"type", "message"}}
"""

from __future__ import annotations

import json
import logging
import math

from aiohttp import web

from undertow.gateway.errors import Busy, ContextTooLong, GatewayError, UnsupportedParameter
from undertow.gateway.front.sessions import Session
from undertow.gateway.front.store import GroupSetAside

log = logging.getLogger(__name__)
SESSION_KEY = web.RequestKey("session", Session)  # set by `common.session_of`
REPLY_STATUS_KEY = web.RequestKey("reply_status", int)  # for `app._metrics_middleware`
GROUP_SET_ASIDE = "group_set_aside"   # the `code` of a set-aside group's 503

_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                 404: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_exceeded", 503: "server_error", 500: "server_error"}
_OPENAI_CODES = {401: "invalid_api_key", 404: "not_found", 413: "request_too_large",
                 429: "rate_limit_exceeded", 503: "service_unavailable"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 500: "api_error"}
# Anthropic reports an overloaded service as 529, which its SDK retries.
_ANTHROPIC_STATUS = {503: 529}


def api_family(path: str) -> str:
    return "anthropic" if "/v1/messages" in path else "openai"


def openai_error(error: GatewayError) -> dict:
    code = _OPENAI_CODES.get(error.status)
    if isinstance(error, ContextTooLong):
        code = "context_length_exceeded"
    elif isinstance(error, UnsupportedParameter):
        code = "unsupported_parameter"
    elif isinstance(error, GroupSetAside):   # the learner tells it from other 503s by it
        code = GROUP_SET_ASIDE
    return {"error": {"message": error.message, "type": _OPENAI_TYPES.get(error.status,
                                                                          "server_error"),
                      "param": error.param, "code": code}}


def anthropic_error(error: GatewayError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(error.status, "api_error"),
                                       "message": error.message}}


def error_body(family: str, error: GatewayError) -> dict:
    return anthropic_error(error) if family == "anthropic" else openai_error(error)


def client_status(family: str, error: GatewayError) -> int:
    """The HTTP status a client of `family` gets for `error`."""
    if family == "anthropic":
        return _ANTHROPIC_STATUS.get(error.status, error.status)
    return error.status


def is_undertows(status: int) -> bool:
    """Whether a reply with `status` is a failure of Undertow's own, not of the request:
    a 5xx (no engine, an engine lost, the store unwritable, a bug), a 429 (admission)."""
    return status >= 500 or status == 429


def note_infra_error(request: web.Request, error: GatewayError, streamed: bool) -> int:
    """Keeps the status `request`'s client gets for `error` (`REPLY_STATUS_KEY`) and, for
    a failure of Undertow's own, notes it on the request's session; returns the status."""
    status = client_status(api_family(request.path), error)
    request[REPLY_STATUS_KEY] = status
    session = request.get(SESSION_KEY)
    if session is not None and is_undertows(status):
        session.note_infra_error(f"{status} {type(error).__name__}"
                                 + (" in a stream" if streamed else ""))
    return status


def error_response(family: str, error: GatewayError) -> web.Response:
    status = client_status(family, error)
    headers = {}
    if isinstance(error, Busy):
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return web.Response(status=status, text=json.dumps(error_body(family, error)),
                        content_type="application/json", headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    family = api_family(request.path)
    try:
        return await handler(request)
    except GatewayError as error:
        if error.status >= 500:   # Undertow's own failure or an engine's: keep its trace
            log.error("%s %s failed: %s", request.method, request.path, error,
                      exc_info=error)
        note_infra_error(request, error, streamed=False)
        return error_response(family, error)
    except web.HTTPException as error:
        if error.status < 400 or request.path.startswith("/admin"):
            raise
        wrapped = GatewayError(error.text or error.reason)
        wrapped.status = error.status
        note_infra_error(request, wrapped, streamed=False)
        return error_response(family, wrapped)
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        error = GatewayError("the gateway failed on this request; see its log")
        note_infra_error(request, error, streamed=False)
        return error_response(family, error)
