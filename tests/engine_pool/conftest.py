"""Fixtures for the engine pool's tests: those that drive it through the gateway take the
gateway's fixtures (`tests/gateway/conftest.py`)."""

from tests.gateway.conftest import make_gateway, renderer

__all__ = ["make_gateway", "renderer"]
