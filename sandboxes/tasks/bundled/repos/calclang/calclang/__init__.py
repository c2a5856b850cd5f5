"""calclang: a tiny scripting language.

``run(source)`` lexes, parses and interprets a program and returns the lines
it printed. The stages are separate modules: lexer -> parser -> interpreter.
"""

from calclang.errors import CalcError, CalcRuntimeError, LexError, ParseError
from calclang.interpreter import Interpreter
from calclang.lexer import tokenize
from calclang.parser import parse


def run(source: str) -> list[str]:
    """Run ``source`` and return what it printed, one string per line."""
    interpreter = Interpreter()
    interpreter.execute(parse(tokenize(source)))
    return interpreter.output


__all__ = ["CalcError", "CalcRuntimeError", "Interpreter", "LexError", "ParseError", "parse",
           "run", "tokenize"]
