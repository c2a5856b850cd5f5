import pytest

from calclang import ParseError, parse, tokenize
from calclang import ast


def expr(source):
    (statement,) = parse(tokenize(source + ";"))
    return statement.expr


def show(node):
    """Render an expression tree fully parenthesized."""
    if isinstance(node, ast.Literal):
        return repr(node.value)
    if isinstance(node, ast.Variable):
        return node.name
    if isinstance(node, ast.Unary):
        return f"({node.op} {show(node.operand)})"
    if isinstance(node, ast.Binary | ast.Logical):
        return f"({show(node.left)} {node.op} {show(node.right)})"
    if isinstance(node, ast.Call):
        return f"{show(node.callee)}({', '.join(show(arg) for arg in node.args)})"
    raise AssertionError(node)


def test_precedence_of_arithmetic():
    assert show(expr("1 + 2 * 3 - 4")) == "((1 + (2 * 3)) - 4)"
    assert show(expr("(1 + 2) * 3")) == "((1 + 2) * 3)"


def test_unary_minus_and_power():
    assert show(expr("-2 ** 2")) == "(- (2 ** 2))"


def test_logic_binds_looser_than_comparison():
    assert show(expr("not a < b and c or d")) == "(((not (a < b)) and c) or d)"


def test_calls():
    assert show(expr("f(1, g(2))(3)")) == "f(1, g(2))(3)"


def test_statements():
    program = parse(tokenize("let x = 1; x = 2; fn f(a, b) { return a; } if (x) { } else { }"))
    assert [type(node).__name__ for node in program] == ["Let", "Assign", "FunctionDef", "If"]
    assert program[2].params == ["a", "b"]


def test_parse_errors_name_the_line():
    with pytest.raises(ParseError, match="line 2: expected ';'"):
        parse(tokenize("let x = 1;\nlet y = 2"))
    with pytest.raises(ParseError, match="never closed"):
        parse(tokenize("fn f() { return 1;"))
