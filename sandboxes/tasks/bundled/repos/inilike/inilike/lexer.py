"""Split inilike text into logical lines.

This is the first stage of parsing. Blank lines and comments are dropped;
what remains is a sequence of :class:`Line` records, each either a section
header or a ``key = value`` pair. An array value may span several physical
lines: the lexer joins them (keeping the line breaks) so that the value
reader sees one piece of text.
"""

import re
from collections.abc import Iterator
from dataclasses import dataclass

from inilike.errors import ParseError

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class Line:
    """One logical line.

    ``kind`` is ``"section"`` or ``"pair"``. ``line_no`` is the 1-based number
    of the first physical line. For pairs, ``value`` is the raw value text with
    comments removed and ``value_column`` the 1-based column where it starts.
    """

    kind: str
    line_no: int
    name: str
    value: str = ""
    value_column: int = 0


def strip_comment(text: str) -> str:
    """Remove a trailing ``#`` or ``;`` comment that is not inside quotes.

    A comment character only starts a comment at the beginning of the text or
    after whitespace, so ``color=#fff`` keeps its value.
    """
    quote = None
    index = 0
    while index < len(text):
        char = text[index]
        if quote:
            if char == "\\" and quote == '"':
                index += 2
                continue
            if char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char in "#;" and (index == 0 or text[index - 1].isspace()):
            return text[:index].rstrip()
        index += 1
    return text.rstrip()


def bracket_depth(text: str) -> int:
    """Return how many ``[`` in ``text`` are still open, ignoring quoted text."""
    depth = 0
    quote = None
    index = 0
    while index < len(text):
        char = text[index]
        if quote:
            if char == "\\" and quote == '"':
                index += 1
            elif char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        index += 1
    return depth


def check_name(name: str, what: str, line_no: int) -> None:
    """Raise :class:`ParseError` unless ``name`` is a valid key or section part."""
    if not NAME_PATTERN.match(name):
        raise ParseError(f"invalid {what} name {name!r}", line_no)


def logical_lines(text: str) -> Iterator[Line]:
    """Yield the section headers and key/value pairs of ``text`` in order."""
    physical = text.splitlines()
    index = 0
    while index < len(physical):
        raw = physical[index]
        line_no = index + 1
        index += 1
        stripped = strip_comment(raw).strip()
        if not stripped:
            continue
        if stripped.startswith("["):
            yield _section_line(stripped, line_no)
            continue
        key, separator, value = stripped.partition("=")
        if not separator:
            raise ParseError("expected 'key = value' or '[section]'", line_no)
        key = key.strip()
        check_name(key, "key", line_no)
        value = value.strip()
        after_equals = raw[raw.index("=") + 1 :]
        column = raw.index("=") + 2 + len(after_equals) - len(after_equals.lstrip())
        while value.startswith("[") and bracket_depth(value) > 0:
            if index >= len(physical):
                raise ParseError("array is never closed", line_no, column)
            value += "\n" + strip_comment(physical[index])
            index += 1
        yield Line("pair", line_no, key, value, column)


def _section_line(stripped: str, line_no: int) -> Line:
    if not stripped.endswith("]"):
        raise ParseError("section header is missing its closing ']'", line_no)
    name = stripped[1:-1].strip()
    for part in name.split("."):
        check_name(part, "section", line_no)
    return Line("section", line_no, name)
