"""The built-in engine's exception hierarchy, under the gateway's root (`gateway/errors.py`).

    BuiltinEngineError
    ├── BadRequest        a request the client must fix (HTTP 400); the message says how
    ├── WeightLoadError   a model directory whose weights do not fit the served model
    ├── StagingConflict   a KV staging not in the state a call assumes (`staging.py`)
    └── TransferConflict  KV not where a transfer request assumes it is (`undertow_kv.py`)
"""

from undertow.gateway.errors import GatewayError


class BuiltinEngineError(GatewayError):
    """Root of the built-in engine's errors."""


class BadRequest(BuiltinEngineError):
    """The request is invalid; answered with HTTP 400 and this message."""


class WeightLoadError(BuiltinEngineError):
    """Weights could not be loaded from a model directory."""
