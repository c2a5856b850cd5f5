"""Turn source text into tokens.

A token is (kind, text, value, line). Kinds are ``number``, ``string``,
``name``, ``keyword``, ``op`` and ``eof``; the token list always ends with
one ``eof`` token.
"""

from dataclasses import dataclass
from typing import Any

from calclang.errors import LexError

KEYWORDS = {"let", "fn", "return", "if", "else", "while", "and", "or", "not", "true", "false", "nil"}
TWO_CHAR_OPS = {"==", "!=", "<=", ">=", "**"}
ONE_CHAR_OPS = set("+-*/%<>=(){},;")
ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    value: Any
    line: int


class _Lexer:
    def __init__(self, source: str):
        self.source = source
        self.pos = 0
        self.line = 1
        self.tokens: list[Token] = []

    def peek(self, offset: int = 0) -> str:
        index = self.pos + offset
        return self.source[index] if index < len(self.source) else ""

    def run(self) -> list[Token]:
        while self.pos < len(self.source):
            char = self.peek()
            if char == "\n":
                self.line += 1
                self.pos += 1
            elif char.isspace():
                self.pos += 1
            elif char == "#":
                self.skip_comment()
            elif char.isdigit():
                self.read_number()
            elif char.isalpha() or char == "_":
                self.read_name()
            elif char == '"':
                self.read_string()
            else:
                self.read_operator()
        self.tokens.append(Token("eof", "", None, self.line))
        return self.tokens

    def skip_comment(self) -> None:
        # Stop at the newline so that run() counts it.
        while self.pos < len(self.source) and self.peek() != "\n":
            self.pos += 1

    def read_number(self) -> None:
        start = self.pos
        while self.peek().isdigit():
            self.pos += 1
        if self.peek() == "." and self.peek(1).isdigit():
            self.pos += 1
            while self.peek().isdigit():
                self.pos += 1
            text = self.source[start : self.pos]
            self.tokens.append(Token("number", text, float(text), self.line))
        else:
            text = self.source[start : self.pos]
            self.tokens.append(Token("number", text, int(text), self.line))

    def read_name(self) -> None:
        start = self.pos
        while self.peek().isalnum() or self.peek() == "_":
            self.pos += 1
        text = self.source[start : self.pos]
        kind = "keyword" if text in KEYWORDS else "name"
        self.tokens.append(Token(kind, text, text, self.line))

    def read_string(self) -> None:
        start, start_line = self.pos, self.line
        self.pos += 1
        chars = []
        while True:
            char = self.peek()
            if char == "":
                raise LexError("string is never closed", start_line)
            self.pos += 1
            if char == '"':
                break
            if char == "\n":
                self.line += 1
            if char == "\\":
                code = self.peek()
                if code not in ESCAPES:
                    raise LexError(f"unknown escape '\\{code}' in string", self.line)
                chars.append(ESCAPES[code])
                self.pos += 1
            else:
                chars.append(char)
        text = self.source[start : self.pos]
        self.tokens.append(Token("string", text, "".join(chars), start_line))

    def read_operator(self) -> None:
        pair = self.source[self.pos : self.pos + 2]
        if pair in TWO_CHAR_OPS:
            self.tokens.append(Token("op", pair, pair, self.line))
            self.pos += 2
            return
        char = self.peek()
        if char in ONE_CHAR_OPS:
            self.tokens.append(Token("op", char, char, self.line))
            self.pos += 1
            return
        raise LexError(f"unexpected character {char!r}", self.line)


def tokenize(source: str) -> list[Token]:
    """Return the tokens of ``source``, ending with an ``eof`` token."""
    return _Lexer(source).run()
