"""One training loop: the modules of the project that define a loop which takes optimizer
steps are exactly the run's loop (`undertow/cells/loop.py`, every `undertow train`, with or without
a pool) and `undertow sft`'s epochs over stored trees (`learner/sft.py`, no rollouts, no
weights pushed).

A function "steps" when it calls the learner's step function (`train_step`), an optimizer's
`step()`, or, through `self.` or by name, a function of the same module that steps; a module
defines a training loop when a `for` or `while` in one of its functions runs a call that
steps. The check reads the source (`ast`), so it also fails on a second loop that is never
run."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("undertow", "gateway", "adapters", "learner", "sandboxes")
TRAINING_LOOPS = {"undertow/cells/loop.py", "learner/sft.py"}


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _steps_directly(call: ast.Call) -> bool:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "train_step":
        return True
    owner = func.value
    owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
    return func.attr == "step" and "optimizer" in owner_name


def _calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def training_loops(source: str) -> list[str]:
    """The functions of `source` with a loop that runs a call that steps."""
    tree = ast.parse(source)
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    stepping = {f.name for f in functions if any(_steps_directly(c) for c in _calls(f))}
    changed = True
    while changed:   # a function calling a stepping function of the module steps too
        grown = {f.name for f in functions
                 if any(_called_name(c) in stepping for c in _calls(f))} | stepping
        changed, stepping = grown != stepping, grown
    found = []
    for function in functions:
        loops = [n for n in ast.walk(function) if isinstance(n, ast.For | ast.While)]
        if any(_steps_directly(c) or _called_name(c) in stepping
               for loop in loops for c in _calls(loop)):
            found.append(function.name)
    return found


def test_the_run_and_sft_are_the_only_training_loops():
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            loops = training_loops(path.read_text())
            if loops:
                found[str(path.relative_to(ROOT))] = loops
    assert set(found) == TRAINING_LOOPS, found
    assert found["undertow/cells/loop.py"] == ["run"]


def test_a_second_loop_is_found_however_it_reaches_the_step():
    through_a_method = """
class Other:
    def go(self):
        while self.more():
            self._one()

    def _one(self):
        self.learner.train_step(self.groups())
"""
    with_an_optimizer = """
def fit(model, optimizer, batches):
    for batch in batches:
        model(batch).backward()
        optimizer.step()
"""
    assert training_loops(through_a_method) == ["go"]
    assert training_loops(with_an_optimizer) == ["fit"]
    assert training_loops("def once(learner, trees):\n    return learner.train_step(trees)\n") == []
