"""Expand ``${...}`` references in string values.

References are expanded lazily, when :class:`inilike.Config` hands a value
out, so that a merged override changes every value that refers to it.
``${key}`` names a key of the section the value lives in, ``${a.b.key}`` a
key anywhere, and ``$$`` stands for a single ``$``.
"""

import re
from collections.abc import Callable

from inilike.errors import InterpolationError, MissingKeyError

REFERENCE = re.compile(r"\$(\$|\{([A-Za-z0-9_.-]+)\})")


def format_scalar(value: object) -> str:
    """Render a non-string value the way it would be written in a file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class Interpolator:
    """Expands references using ``lookup``, which maps a dotted path to a raw value."""

    def __init__(self, lookup: Callable[[str], object]):
        self._lookup = lookup

    def expand(self, text: str, section: str, resolving: set[str] | None = None) -> str:
        """Expand every reference in ``text``, a value of ``section`` ("" for the root)."""
        if resolving is None:
            resolving = set()

        def replace(match: re.Match) -> str:
            if match.group(1) == "$":
                return "$"
            return self._resolve(match.group(2), section, resolving)

        return REFERENCE.sub(replace, text)

    def _resolve(self, reference: str, section: str, resolving: set[str]) -> str:
        path = reference if "." in reference or not section else f"{section}.{reference}"
        if path in resolving:
            raise InterpolationError(f"reference cycle through '{path}'")
        try:
            raw = self._lookup(path)
        except MissingKeyError:
            raise InterpolationError(
                f"'${{{reference}}}' refers to '{path}', which does not exist"
            ) from None
        if isinstance(raw, dict):
            raise InterpolationError(f"'${{{reference}}}' refers to a section, not a value")
        if not isinstance(raw, str):
            return format_scalar(raw)
        resolving.add(path)
        try:
            return self.expand(raw, path.rpartition(".")[0], resolving)
        finally:
            resolving.discard(path)
