"""The gateway's exceptions, one tree with one root (docs/design.md, "Errors"). Each API
writes them in its SDK's error shape (`front/api/errors.py`); the others become API errors
where they reach a scaffold's call (`front/calls.py`).

    GatewayError                 500  (anything unexpected)
    ├── BadRequest               400  malformed JSON, bad fields, template refusal
    │   ├── UnsupportedParameter 400  a parameter the gateway cannot honour
    │   └── ContextTooLong       400  prompt (+ max tokens) past the context limit
    ├── Unauthorized             401  unknown session or key
    ├── NotFound                 404  unknown session, group or route
    ├── PayloadTooLarge          413  body over `max_body_bytes`
    ├── Busy                     429  engine pool at its admission limit (Retry-After)
    ├── Unavailable              503  no engine alive
    ├── PoolError                     the engine pool (`engine_pool/pool.py`), below
    │   ├── PoolBusy             429  every engine at its admission limit -> Busy
    │   ├── PoolUnavailable      503  no healthy engine -> Unavailable
    │   ├── CallerLeft           499  the client left while its call waited for admission
    │   └── UnknownEngine        404  (also a KeyError) no engine with this ID
    ├── EngineError              502  an engine driver or launcher (`engines/protocol.py`)
    │   ├── EngineUnavailable         no answer, a dropped stream, a 5xx, a bad reply
    │   ├── EngineRejected            the engine refused (4xx, `status`) -> BadRequest
    │   │   ├── WeightsNotUpdated     a weight update did not complete
    │   │   └── IncompatibleCheckpoint  a checkpoint that does not fit the served model
    │   ├── EngineLaunchError         a launcher could not start an engine
    │   └── HttpError                 a failed or broken connection (`engines/http1.py`)
    ├── StoreDamaged                  (also a ValueError) a damaged line (`front/store.py`)
    └── BuiltinEngineError            the built-in engine (`builtin_engine/errors.py`)
        ├── BadRequest                its HTTP 400
        ├── WeightLoadError           weights that do not fit the served model
        ├── StagingConflict           a KV staging in another state (`staging.py`)
        └── TransferConflict          KV not where a transfer assumes (`undertow_kv.py`)

The trees' `TreeError` is no `GatewayError` (`trees/errors.py`).
"""

from __future__ import annotations


class GatewayError(Exception):
    """Base class; `status` is the HTTP status; `param` names the offending field."""

    status = 500
    kind = "server_error"

    def __init__(self, message: str = "", param: str | None = None):
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


class PoolError(GatewayError):
    """Base of the engine pool's errors (`engine_pool/pool.py`)."""


class PoolBusy(PoolError):
    """Every engine is at its admission limit; retry after `retry_after_s`."""

    status = 429
    kind = "rate_limit"

    def __init__(self, retry_after_s: float, waited_s: float = 0.0):
        waited = (f" for the {waited_s:g} s the call waited (router.admission_wait_s)"
                  if waited_s else "")
        super().__init__(f"all engines are at their admission limit{waited}; retry in "
                         f"{retry_after_s} s")
        self.retry_after_s = retry_after_s


class PoolUnavailable(PoolError):
    """No healthy engine; add one (POST /admin/engines) or wait for one to recover."""

    status = 503
    kind = "overloaded"


class CallerLeft(PoolError):
    """The client closed its connection while its call waited for admission (nginx's
    499: nobody reads the reply; counted as a client disconnect)."""

    status = 499
    kind = "client_closed_request"


class UnknownEngine(PoolError, KeyError):
    """No engine with this ID is in the pool; list them with GET /admin/engines."""

    status = 404
    kind = "not_found"
