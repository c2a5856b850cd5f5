"""Variable scopes: each block or function call gets an Environment whose
parent is the scope it was created in."""

from typing import Any

from calclang.errors import CalcRuntimeError


class Environment:
    """A mapping of names to values with a link to the enclosing scope.

    ``define`` always writes to this scope; ``assign`` and ``lookup`` walk out
    through the parents to the nearest scope that declares the name.
    """

    def __init__(self, parent: "Environment | None" = None):
        self.parent = parent
        self.values: dict[str, Any] = {}

    def define(self, name: str, value: Any, line: int) -> None:
        if name in self.values:
            raise CalcRuntimeError(f"'{name}' is already declared in this scope", line)
        self.values[name] = value

    def lookup(self, name: str, line: int) -> Any:
        return self._scope_of(name, line).values[name]

    def assign(self, name: str, value: Any, line: int) -> None:
        self._scope_of(name, line).values[name] = value

    def _scope_of(self, name: str, line: int) -> "Environment":
        scope: Environment | None = self
        while scope is not None:
            if name in scope.values:
                return scope
            scope = scope.parent
        raise CalcRuntimeError(f"'{name}' is not declared; use 'let {name} = ...' first", line)
