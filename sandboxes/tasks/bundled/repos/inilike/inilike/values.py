"""Turn the raw text of a value into a Python value.

Called by the parser for every ``key = value`` pair. Supported forms:
double-quoted strings with escapes, single-quoted literal strings, integers,
floats, booleans, arrays (nested, possibly spanning lines) and bare text.
"""

import re
import string

from inilike.errors import ParseError

INT_PATTERN = re.compile(r"[+-]?(0|[1-9](_?[0-9])*)$")
HEX_PATTERN = re.compile(r"0x[0-9A-Fa-f](_?[0-9A-Fa-f])*$")
FLOAT_PATTERN = re.compile(
    r"[+-]?(0|[1-9](_?[0-9])*)(\.[0-9](_?[0-9])*)?([eE][+-]?[0-9]+)?$"
)
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "0": "\0"}

Value = str | int | float | bool | list


def convert_bare(token: str) -> Value:
    """Convert unquoted text: booleans and numbers are recognised, the rest stays text."""
    if token == "true":
        return True
    if token == "false":
        return False
    if HEX_PATTERN.match(token):
        return int(token[2:].replace("_", ""), 16)
    if INT_PATTERN.match(token):
        return int(token.replace("_", ""))
    if FLOAT_PATTERN.match(token):
        return float(token.replace("_", ""))
    return token


def parse_value(text: str, line_no: int, column: int) -> Value:
    """Parse the value ``text`` that starts at (``line_no``, ``column``)."""
    if not text:
        raise ParseError("missing value after '='", line_no, column)
    reader = _Reader(text, line_no, column)
    value = reader.read_value(top_level=True)
    reader.skip_space()
    if reader.pos != len(text):
        raise reader.error("unexpected text after the value", reader.pos)
    return value


class _Reader:
    """A cursor over one value's text; ``pos`` is the index of the next character."""

    def __init__(self, text: str, line_no: int, column: int):
        self.text = text
        self.pos = 0
        self.line_no = line_no
        self.column = column

    def error(self, message: str, pos: int) -> ParseError:
        line_no, column = self.location(pos)
        return ParseError(message, line_no, column)

    def location(self, pos: int) -> tuple[int, int]:
        """Return the 1-based (line, column) of ``pos`` in the original file."""
        num_breaks = self.text.count("\n", 0, pos)
        if num_breaks == 0:
            return self.line_no, self.column + pos
        last_break = self.text.rindex("\n", 0, pos)
        return self.line_no + num_breaks, pos - last_break

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def read_value(self, top_level: bool = False) -> Value:
        char = self.text[self.pos]
        if char == "[":
            return self.read_array()
        if char == '"':
            return self.read_basic_string()
        if char == "'":
            return self.read_literal_string()
        return self.read_bare(top_level)

    def read_bare(self, top_level: bool) -> Value:
        start = self.pos
        if top_level:
            self.pos = len(self.text)
        else:
            while self.pos < len(self.text) and self.text[self.pos] not in ",]\n":
                self.pos += 1
        token = self.text[start : self.pos].strip()
        if not token:
            raise self.error("missing value", start)
        return convert_bare(token)

    def read_array(self) -> list:
        start = self.pos
        self.pos += 1
        items = []
        while True:
            self.skip_space()
            if self.pos >= len(self.text):
                raise self.error("array is never closed", start)
            if self.text[self.pos] == "]":
                self.pos += 1
                return items
            items.append(self.read_value())
            self.skip_space()
            if self.pos < len(self.text) and self.text[self.pos] == ",":
                self.pos += 1
            elif self.pos < len(self.text) and self.text[self.pos] != "]":
                raise self.error("expected ',' or ']' in array", self.pos)

    def read_literal_string(self) -> str:
        end = self.text.find("'", self.pos + 1)
        if end == -1:
            raise self.error("string is never closed", self.pos)
        value = self.text[self.pos + 1 : end]
        self.pos = end + 1
        return value

    def read_basic_string(self) -> str:
        start = self.pos
        self.pos += 1
        chars = []
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == '"':
                self.pos += 1
                return "".join(chars)
            if char == "\\":
                chars.append(self.read_escape())
            else:
                chars.append(char)
                self.pos += 1
        raise self.error("string is never closed", start)

    def read_escape(self) -> str:
        code = self.text[self.pos + 1 : self.pos + 2]
        if code == "u":
            digits = self.text[self.pos + 2 : self.pos + 6]
            if len(digits) != 4 or not all(c in string.hexdigits for c in digits):
                raise self.error("\\u needs four hex digits", self.pos)
            self.pos += 6
            return chr(int(digits, 16))
        if code not in ESCAPES:
            raise self.error(f"unknown escape '\\{code}'", self.pos)
        self.pos += 2
        return ESCAPES[code]
