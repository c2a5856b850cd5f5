"""The gateway's exceptions. Each API formats them in its own SDKs' error shape
(`api/errors.py`); the status code is fixed here.

    GatewayError                 500  (anything unexpected)
    ├── BadRequest               400  malformed JSON, bad fields, template refusal
    │   ├── UnsupportedParameter 400  a parameter the gateway cannot honour
    │   └── ContextTooLong       400  prompt (+ max tokens) past the context limit
    ├── Unauthorized             401  unknown session or key
    ├── NotFound                 404  unknown session, group or route
    ├── PayloadTooLarge          413  body over `max_body_bytes`
    ├── Busy                     429  engine pool at its admission limit (Retry-After)
    └── Unavailable              503  no engine alive
"""

from __future__ import annotations


class GatewayError(Exception):
    """Base class; `status` is the HTTP status; `param` names the offending field."""

    status = 500
    kind = "server_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(GatewayError):
    status = 400
    kind = "invalid_request"


class UnsupportedParameter(BadRequest):
    kind = "unsupported_parameter"


class ContextTooLong(BadRequest):
    kind = "context_length_exceeded"


class Unauthorized(GatewayError):
    status = 401
    kind = "authentication"


class NotFound(GatewayError):
    status = 404
    kind = "not_found"


class PayloadTooLarge(GatewayError):
    status = 413
    kind = "request_too_large"


class Busy(GatewayError):
    status = 429
    kind = "rate_limit"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(GatewayError):
    status = 503
    kind = "overloaded"
