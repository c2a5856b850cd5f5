"""The built-in engine's exception hierarchy.

    EngineError
    ├── BadRequest        a request the client must fix (HTTP 400); the message says how
    └── WeightLoadError   a model directory whose weights do not fit the served model
"""


class EngineError(Exception):
    """Root of the built-in engine's errors."""


class BadRequest(EngineError):
    """The request is invalid; answered with HTTP 400 and this message."""


class WeightLoadError(EngineError):
    """Weights could not be loaded from a model directory."""
