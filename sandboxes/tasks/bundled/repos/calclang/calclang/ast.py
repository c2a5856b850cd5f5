"""Syntax tree nodes produced by the parser and walked by the interpreter.

Every node records the source ``line`` it starts on, for error messages.
"""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Node:
    line: int


@dataclass
class Literal(Node):
    value: Any


@dataclass
class Variable(Node):
    name: str


@dataclass
class Unary(Node):
    op: str
    operand: Node


@dataclass
class Binary(Node):
    op: str
    left: Node
    right: Node


@dataclass
class Logical(Node):
    """``and`` / ``or``, kept apart from Binary because they short-circuit."""

    op: str
    left: Node
    right: Node


@dataclass
class Call(Node):
    callee: Node
    args: list[Node]


@dataclass
class Let(Node):
    name: str
    value: Node


@dataclass
class Assign(Node):
    name: str
    value: Node


@dataclass
class ExprStmt(Node):
    expr: Node


@dataclass
class Block(Node):
    body: list[Node] = field(default_factory=list)


@dataclass
class If(Node):
    condition: Node
    then: Block
    otherwise: Node | None


@dataclass
class While(Node):
    condition: Node
    body: Block


@dataclass
class FunctionDef(Node):
    name: str
    params: list[str]
    body: Block


@dataclass
class Return(Node):
    value: Node | None
