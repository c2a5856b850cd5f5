"""Exceptions raised by inilike.

    InilikeError
    ├── ParseError            the text is not valid inilike syntax
    └── ConfigError           a parsed document was used in a way it cannot serve
        ├── MissingKeyError   a key or section does not exist
        └── InterpolationError a ${...} reference cannot be expanded
"""


class InilikeError(Exception):
    """Base class of every error raised by this package."""


class ParseError(InilikeError):
    """The input text is not valid; ``line_no`` and ``column`` are 1-based."""

    def __init__(self, message: str, line_no: int, column: int | None = None):
        self.message = message
        self.line_no = line_no
        self.column = column
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"line {self.line_no}"
        if self.column is not None:
            where += f", column {self.column}"
        return f"{where}: {self.message}"


class ConfigError(InilikeError):
    """A parsed configuration was asked for something it cannot give."""


class MissingKeyError(ConfigError, KeyError):
    """The requested key or section is not in the configuration."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "missing key"


class InterpolationError(ConfigError):
    """A ``${...}`` reference points nowhere or forms a cycle."""
