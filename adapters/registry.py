"""Scaffolds by short name: a plain dict of import paths, resolved when chosen
(`create_scaffold`). A new scaffold is a new module plus one line here.
"""

import importlib
from collections.abc import Mapping
from typing import Any

from undertow.adapters.base import Scaffold
from undertow.adapters.errors import RolloutError

SCAFFOLDS: dict[str, str] = {
    "mini-swe-agent": "undertow.adapters.mini_swe_agent.MiniSweAgent",
    "command": "undertow.adapters.command.CommandScaffold",
    "claude-code": "undertow.adapters.configs.presets.claude_code",
    "codex": "undertow.adapters.configs.presets.codex",
    "swe-agent": "undertow.adapters.configs.presets.swe_agent",
    "openhands": "undertow.adapters.configs.presets.openhands",
}


def create_scaffold(name: str, options: Mapping[str, Any] | None = None) -> Scaffold:
    """The scaffold called `name`, built with `options` (its dataclass fields or preset
    arguments); raises RolloutError for an unknown name or option."""
    if name not in SCAFFOLDS:
        raise RolloutError(f"unknown scaffold {name!r}; choose one of {sorted(SCAFFOLDS)}")
    module_name, attribute = SCAFFOLDS[name].rsplit(".", 1)
    factory = getattr(importlib.import_module(module_name), attribute)
    try:
        return factory(**dict(options or {}))
    except TypeError as error:
        raise RolloutError(f"scaffold {name!r}: bad options {dict(options or {})}: {error}") \
            from None
