"""Fixtures for the built-in engine's tests, shared with the drivers' tests (the conformance
suite runs against the built-in engine too), so defined in `tests/engines/conftest.py`."""

from tests.engines.conftest import builtin_engine_url, other_tiny_model_dir, start_engine

__all__ = ["builtin_engine_url", "other_tiny_model_dir", "start_engine"]
