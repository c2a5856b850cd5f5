"""Errors of calclang programs, each carrying the source line it comes from.

    CalcError
    ├── LexError          a character or literal the lexer cannot read
    ├── ParseError        tokens that do not form a program
    └── CalcRuntimeError  a program that fails while running
"""


class CalcError(Exception):
    """Base class; ``line`` is the 1-based source line of the problem."""

    def __init__(self, message: str, line: int):
        self.message = message
        self.line = line
        super().__init__(f"line {line}: {message}")


class LexError(CalcError):
    pass


class ParseError(CalcError):
    pass


class CalcRuntimeError(CalcError):
    pass
