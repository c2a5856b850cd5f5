"""A tree-walking interpreter for parsed calclang programs."""

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from calclang import ast
from calclang.environment import Environment
from calclang.errors import CalcRuntimeError

MAX_CALL_DEPTH = 200
ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
              "%": operator.mod, "**": operator.pow}
COMPARISONS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
               ">": operator.gt, ">=": operator.ge}


@dataclass
class Function:
    """A user-defined function and the scope it was defined in (its closure)."""

    definition: ast.FunctionDef
    closure: Environment


@dataclass
class Builtin:
    name: str
    num_params: int | None
    call: Callable[..., Any]


class _ReturnSignal(Exception):
    def __init__(self, value: Any):
        self.value = value


def format_value(value: Any) -> str:
    """Render a value the way ``print`` and ``str`` show it."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return f"{value:.1f}"
    if isinstance(value, Function):
        return f"<fn {value.definition.name}>"
    if isinstance(value, Builtin):
        return f"<builtin {value.name}>"
    return str(value)


def is_truthy(value: Any) -> bool:
    """false, nil, 0 and "" are false; everything else is true."""
    return value not in (False, None, 0, "")


class Interpreter:
    """Runs statements; ``output`` collects the printed lines."""

    def __init__(self):
        self.output: list[str] = []
        self.globals = Environment()
        self.depth = 0
        for builtin in [
            Builtin("print", None, lambda *args: self.output.append(" ".join(map(format_value, args)))),
            Builtin("len", 1, len),
            Builtin("str", 1, format_value),
            Builtin("int", 1, int),
        ]:
            self.globals.define(builtin.name, builtin, 0)

    def execute(self, statements: list[ast.Node]) -> None:
        for statement in statements:
            self.run_statement(statement, self.globals)

    def run_block(self, block: ast.Block, env: Environment) -> None:
        for statement in block.body:
            self.run_statement(statement, env)

    def run_statement(self, node: ast.Node, env: Environment) -> None:
        if isinstance(node, ast.Let):
            env.define(node.name, self.evaluate(node.value, env), node.line)
        elif isinstance(node, ast.Assign):
            env.assign(node.name, self.evaluate(node.value, env), node.line)
        elif isinstance(node, ast.ExprStmt):
            self.evaluate(node.expr, env)
        elif isinstance(node, ast.Block):
            self.run_block(node, Environment(env))
        elif isinstance(node, ast.If):
            if is_truthy(self.evaluate(node.condition, env)):
                self.run_block(node.then, Environment(env))
            elif node.otherwise is not None:
                self.run_statement(node.otherwise, env)
        elif isinstance(node, ast.While):
            while is_truthy(self.evaluate(node.condition, env)):
                self.run_block(node.body, Environment(env))
        elif isinstance(node, ast.FunctionDef):
            env.define(node.name, Function(node, env), node.line)
        elif isinstance(node, ast.Return):
            value = None if node.value is None else self.evaluate(node.value, env)
            raise _ReturnSignal(value)
        else:
            raise CalcRuntimeError(f"cannot run {type(node).__name__}", node.line)

    def evaluate(self, node: ast.Node, env: Environment) -> Any:
        if isinstance(node, ast.Literal):
            return node.value
        if isinstance(node, ast.Variable):
            return env.lookup(node.name, node.line)
        if isinstance(node, ast.Logical):
            left = self.evaluate(node.left, env)
            if node.op == "or":
                return left if is_truthy(left) else self.evaluate(node.right, env)
            return self.evaluate(node.right, env) if is_truthy(left) else left
        if isinstance(node, ast.Unary):
            operand = self.evaluate(node.operand, env)
            if node.op == "not":
                return not is_truthy(operand)
            return self.arithmetic("-", 0, operand, node.line)
        if isinstance(node, ast.Binary):
            left = self.evaluate(node.left, env)
            right = self.evaluate(node.right, env)
            if node.op in COMPARISONS:
                return self.compare(node.op, left, right, node.line)
            return self.arithmetic(node.op, left, right, node.line)
        if isinstance(node, ast.Call):
            callee = self.evaluate(node.callee, env)
            args = [self.evaluate(arg, env) for arg in node.args]
            return self.call(callee, args, node.line)
        raise CalcRuntimeError(f"cannot evaluate {type(node).__name__}", node.line)

    def arithmetic(self, op: str, left: Any, right: Any, line: int) -> Any:
        numbers = (int, float)
        both_numbers = all(isinstance(v, numbers) and not isinstance(v, bool) for v in (left, right))
        both_strings = isinstance(left, str) and isinstance(right, str)
        if not (both_numbers or (op == "+" and both_strings)):
            raise CalcRuntimeError(
                f"cannot apply '{op}' to {format_value(left)!r} and {format_value(right)!r}", line
            )
        if op in ("/", "%") and right == 0:
            raise CalcRuntimeError("division by zero", line)
        return ARITHMETIC[op](left, right)

    def compare(self, op: str, left: Any, right: Any, line: int) -> bool:
        if op in ("==", "!="):
            return COMPARISONS[op](left, right)
        try:
            return COMPARISONS[op](left, right)
        except TypeError:
            raise CalcRuntimeError(
                f"cannot compare {format_value(left)!r} and {format_value(right)!r} with '{op}'", line
            ) from None

    def call(self, callee: Any, args: list[Any], line: int) -> Any:
        if isinstance(callee, Builtin):
            if callee.num_params is not None and len(args) != callee.num_params:
                raise CalcRuntimeError(f"{callee.name}() takes {callee.num_params} argument(s)", line)
            try:
                return callee.call(*args)
            except (TypeError, ValueError) as error:
                raise CalcRuntimeError(f"{callee.name}(): {error}", line) from None
        if not isinstance(callee, Function):
            raise CalcRuntimeError(f"{format_value(callee)!r} is not a function", line)
        params = callee.definition.params
        if len(args) != len(params):
            raise CalcRuntimeError(
                f"{callee.definition.name}() takes {len(params)} argument(s), got {len(args)}", line
            )
        if self.depth >= MAX_CALL_DEPTH:
            raise CalcRuntimeError("too much recursion", line)
        scope = Environment(callee.closure)
        for name, value in zip(params, args, strict=True):
            scope.define(name, value, line)
        self.depth += 1
        try:
            self.run_block(callee.definition.body, scope)
        except _ReturnSignal as signal:
            return signal.value
        finally:
            self.depth -= 1
        return None
