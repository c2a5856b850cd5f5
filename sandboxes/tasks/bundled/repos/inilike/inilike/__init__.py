"""inilike: parse and write INI-style configuration files.

The public API is small: :func:`loads` and :func:`load` turn text into a
:class:`Config`, and :func:`dumps` turns a :class:`Config` back into text.
"""

from inilike.config import Config
from inilike.errors import (
    ConfigError,
    InilikeError,
    InterpolationError,
    MissingKeyError,
    ParseError,
)
from inilike.parser import load, loads
from inilike.writer import dumps

__all__ = [
    "Config",
    "ConfigError",
    "InilikeError",
    "InterpolationError",
    "MissingKeyError",
    "ParseError",
    "dumps",
    "load",
    "loads",
]
