"""Objects are whole when built (STYLE.md): no module of the project finishes or patches an
object of another package by assigning its attributes.

The rule, checked on the source (`ast`): inside a function, an assignment (`=`, `+=`, an
annotated one, a tuple target or `setattr`) to `x.attr`, where `x` is a parameter of the
function (or of one around it) or a part of `self` (`self.part.attr`), is from outside
unless the class of `x` belongs to the module's own package folder: defined in the module,
or imported from a module beside it. A package's records and the code that fills them in
live together (a scheduler and its requests, a rollout and its session results); another
package's objects are built whole and changed through their methods. The class comes from
annotations: the parameter's, or, for `self.part`, the class body's (`part: T`,
`self.part: T = ...`, `self.part = T(...)`, `self.part = param` with `param: T`). An
object whose class cannot be read is from outside: annotate it. `self.attr = ...` (an
object's own attributes) and `local.attr = ...` on an object the function built are never
from outside.

`ALLOWED` lists what is legitimate nevertheless, with the reason."""

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("undertow", "gateway", "adapters", "learner", "sandboxes")
# The bundled SWE tasks' repositories are task data that the agents edit, not project code.
SKIPPED = ("sandboxes/tasks/bundled/repos/",)

# (module, function, target): why it is legitimate. "TODO issue 39": not legitimate, left to
# the module's owner.
ALLOWED = {
    ("learner/attention.py", "forward", "ctx.blocks"):
        "torch.autograd.Function: `ctx` is how torch hands values to `backward`",
    ("learner/attention.py", "forward", "ctx.scaling"):
        "torch.autograd.Function: `ctx` is how torch hands values to `backward`",
    ("learner/lm_head.py", "forward", "ctx.chunk_tokens"):
        "torch.autograd.Function: `ctx` is how torch hands values to `backward`",
    ("learner/lm_head.py", "forward", "ctx.with_entropy"):
        "torch.autograd.Function: `ctx` is how torch hands values to `backward`",
    ("learner/segments.py", "forward", "ctx.scorer"):
        "torch.autograd.Function: `ctx` is how torch hands values to `backward`",
    ("learner/segments.py", "forward", "ctx.with_entropy"):
        "torch.autograd.Function: `ctx` is how torch hands values to `backward`",
}


def _flat(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        return [leaf for element in target.elts for leaf in _flat(element)]
    if isinstance(target, ast.Starred):
        return _flat(target.value)
    return [target]


def _assigned(node: ast.AST) -> list[ast.expr]:
    """The targets `node` assigns (a `setattr(x, "name", v)` call as `x.name`)."""
    if isinstance(node, ast.Assign):
        return [leaf for target in node.targets for leaf in _flat(target)]
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return _flat(node.target)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "setattr" and len(node.args) == 3
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return [ast.Attribute(value=node.args[0], attr=node.args[1].value, ctx=ast.Store())]
    return []


def _class_name(annotation: ast.expr | None) -> str | None:
    """The class an annotation names: `T`, `mod.T`, `"T"`, `T | None`, `Optional[T]`."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _class_name(ast.parse(annotation.value, mode="eval").body)
    if isinstance(annotation, ast.BinOp):   # T | None
        left, right = _class_name(annotation.left), _class_name(annotation.right)
        return left if left not in (None, "None") else right
    if isinstance(annotation, ast.Subscript):
        outer = _class_name(annotation.value)
        return _class_name(annotation.slice) if outer == "Optional" else outer
    if isinstance(annotation, ast.Attribute):
        return annotation.attr
    return annotation.id if isinstance(annotation, ast.Name) else None


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, str | None]:
    """Each parameter's name and the class its annotation names."""
    arguments = function.args
    every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
             *(a for a in (arguments.vararg, arguments.kwarg) if a is not None)]
    return {argument.arg: _class_name(argument.annotation) for argument in every}


def _own_nodes(function: ast.AST) -> list[ast.AST]:
    """The nodes of `function`'s body, not those of the functions and classes inside it."""
    nodes, stack = [], list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        nodes.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def _attribute_classes(cls: ast.ClassDef) -> dict[str, str | None]:
    """The class of each `self.part` as the class body declares or builds it."""
    classes: dict[str, str | None] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            classes[node.target.id] = _class_name(node.annotation)
    for method in cls.body:
        if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        parameters = _parameters(method)
        for node in _own_nodes(method):
            if isinstance(node, ast.AnnAssign) and _is_self_part(node.target):
                classes.setdefault(node.target.attr, _class_name(node.annotation))  # type: ignore[union-attr]
            elif isinstance(node, ast.Assign):
                for target, value in _pairs(node):
                    if _is_self_part(target):
                        classes.setdefault(target.attr, _value_class(value, parameters))  # type: ignore[union-attr]
    return classes


def _is_self_part(target: ast.expr) -> bool:
    return (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
            and target.value.id == "self")


def _pairs(node: ast.Assign) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) pairs of `a = v` and `a, b = v, w`."""
    pairs = []
    for target in node.targets:
        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                and len(target.elts) == len(node.value.elts):
            pairs.extend(zip(target.elts, node.value.elts, strict=True))
        else:
            pairs.append((target, node.value))
    return pairs


def _value_class(value: ast.expr, parameters: dict[str, str | None]) -> str | None:
    if isinstance(value, ast.Call):
        return _class_name(value.func)
    if isinstance(value, ast.Name):
        return parameters.get(value.id)
    return None


FOLDERS = {"undertow.gateway": "gateway", "undertow.learner": "learner",
           "undertow.adapters": "adapters", "undertow.sandboxes": "sandboxes"}


def _folder_of(module: str) -> str:
    """The package folder of a module name: `undertow.gateway.trees.tree` -> gateway/trees."""
    for name, folder in FOLDERS.items():
        if module == name or module.startswith(name + "."):
            module = folder + module[len(name):]
            break
    return "/".join(module.split(".")[:-1])


def own_classes(source: str, folder: str) -> set[str]:
    """The classes `source` defines or imports from a module of `folder` (its own)."""
    tree = ast.parse(source)
    own = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                and _folder_of(node.module) == folder:
            own.update(alias.asname or alias.name for alias in node.names)
    return own


def assignments_from_outside(source: str, folder: str = "") -> list[tuple[str, str]]:
    """(function, target) of every assignment from outside in `source`, a module of the
    package folder `folder` (the module doc)."""
    tree = ast.parse(source)
    local_classes = own_classes(source, folder)
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, cls: ast.ClassDef | None, outer: dict[str, str | None]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child, outer)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                parameters = _parameters(child)
                is_method = cls is not None and not any(
                    isinstance(d, ast.Name) and d.id == "staticmethod"
                    for d in child.decorator_list)
                me = next(iter(parameters), None) if is_method else None
                foreign = {**outer, **{k: v for k, v in parameters.items() if k != me}}
                parts = _attribute_classes(cls) if cls is not None and me == "self" else {}
                for node in _own_nodes(child):
                    for target in _assigned(node):
                        owner = _outside_owner(target, me, foreign, parts)
                        if owner is not None and owner[1] not in local_classes:
                            found.append((node.lineno, child.name, ast.unparse(target)))
                visit(child, None, foreign)
            else:
                visit(child, cls, outer)

    visit(tree, None, {})
    return [(function, target) for _line, function, target in sorted(found)]


def _outside_owner(target: ast.expr, me: str | None, foreign: dict[str, str | None],
                   parts: dict[str, str | None]) -> tuple[str, str | None] | None:
    """(name, class) of the object whose attribute `target` sets, when it is a parameter or
    a part of `self`; None for `self.attr`, locals and anything not an attribute."""
    if not isinstance(target, ast.Attribute):
        return None
    owner = target.value
    if isinstance(owner, ast.Name):
        return (owner.id, foreign[owner.id]) if owner.id in foreign else None
    root = owner
    while isinstance(root, ast.Attribute):
        root = root.value
    if not isinstance(root, ast.Name):
        return None
    if root.id == me and isinstance(owner, ast.Attribute) and owner.value is root:
        return owner.attr, parts.get(owner.attr)
    return (root.id, None) if root.id == me or root.id in foreign else None


@functools.cache
def _project_findings() -> dict[tuple[str, str, str], None]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = str(path.relative_to(ROOT))
            if module.startswith(SKIPPED):
                continue
            folder = str(path.parent.relative_to(ROOT))
            for function, target in assignments_from_outside(path.read_text(), folder):
                found[(module, function, target)] = None
    return found


def test_no_module_assigns_attributes_of_objects_it_did_not_create():
    found = [key for key in _project_findings() if key not in ALLOWED]
    assert found == [], "\n".join(f"{m}: {f}: {t}" for m, f, t in found)


def test_every_allowed_assignment_is_still_there():
    assert set(ALLOWED) - set(_project_findings()) == set()


def test_the_rule_tells_patching_from_a_records_own_module():
    patched = """
from undertow.cells.elastic.local import CellSlots

class Loop:
    def __init__(self, pool: CellSlots, learner):
        self.pool, self.learner = pool, learner
        self.pool.dispatch = self._dispatch
        setattr(learner, "coordinator", None)

def wire(learner, slots: CellSlots):
    slots.weights = (1, 2)
    learner.state.step += 1
"""
    own_record = """
from dataclasses import dataclass

@dataclass
class Result:
    reward: float = 0.0

class Runner:
    def __init__(self, result: Result):
        self.result = result
        self.count = 0

    def grade(self, result: Result) -> None:
        result.reward, self.count = 1.0, self.count + 1
        self.result.reward = 0.5
        local = Loop()
        local.pool = None
"""
    assert assignments_from_outside(patched) == [
        ("__init__", "self.pool.dispatch"), ("__init__", "learner.coordinator"),
        ("wire", "slots.weights"), ("wire", "learner.state.step")]
    assert assignments_from_outside(own_record) == []
