"""A procedurally generated family of SWE tasks for the held-out learning benchmark.

    python -m benchmarks.learning_tasks --out DIR [--num-instances 300] [--seed 0]
                                        [--heldout-fraction 0.25] [--difficulty numbers]

Three small repositories (`shopcalc`, `gridgame`, `textfmt`), five modules each; every
module holds one function whose body uses one number (a rate, a width, a limit). An
instance is a module and two different numbers: in its base state the function uses the
wrong one, its problem statement names the module, the function, the wrong number and
the right one (and one call's expected and actual result), its gold `patch` puts the
right number in, and its held-back test checks the call with the right number. So the
statement determines the fix, instances of one module need different edits, and a
policy can only generalise to a held-out instance by reading the numbers off its
statement. `--difficulty` sets how much the statement gives away (`DIFFICULTIES`:
"line" also quotes the line before and after the fix, "numbers" is the above, "call"
shows only the call's wrong and expected results); the repositories and patches are
the same at every difficulty.

Written in the bundled task format (`sandboxes/taskset.py`), one folder per split:

    DIR/train/tasks.jsonl, DIR/train/repos/<instance_id>/    (the FIXED state)
    DIR/heldout/tasks.jsonl, DIR/heldout/repos/<instance_id>/

The split is by instance (a seeded shuffle), so every module appears in both splits
with different numbers. Base commits are stamped (`stamp_task_set`); images are built
per task on first use (`sandboxes/task_image.py`, from the Debian base image). Output
depends only on the arguments: the same seed gives byte-identical folders.
"""

from __future__ import annotations

import argparse
import difflib
import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

MIN_VALUE, MAX_VALUE = 3, 99
TEST_CMD = "python -m pytest -rA -p no:cacheprovider"
CORE_TEST = "tests/test_core.py::test_every_module_imports"


@dataclass(frozen=True)
class Site:
    """One module of a repository and the number its function uses.

    `body` is the module's source with `{value}`; `call` is a Python expression whose
    result `expected(value)` gives; `complaint` is the statement's first sentence, with
    `{wrong}` and `{right}`. Invariant: `expected` differs for any two values in
    [MIN_VALUE, MAX_VALUE] (checked when an instance is drawn)."""

    repo: str
    module: str
    function: str
    body: str
    call: str
    expected: Callable[[int], object]
    complaint: str

    @property
    def path(self) -> str:
        return f"{self.repo}/{self.module}.py"


def _site(repo: str, module: str, signature: str, line: str, call: str,
          expected: Callable[[int], object], complaint: str) -> Site:
    function = signature.split("(", 1)[0]
    body = f"def {signature}:\n    {line}\n"
    return Site(repo, module, function, body, call, expected, complaint)


SITES: tuple[Site, ...] = (
    _site("shopcalc", "shipping", "shipping_fee(weight)", "return weight * {value}",
          "shipping_fee(10)", lambda v: 10 * v,
          "Shipping is charged at {wrong} per kg; the rate is {right} per kg."),
    _site("shopcalc", "discount", "member_price(price)", "return price - {value}",
          "member_price(200)", lambda v: 200 - v,
          "Members get {wrong} off instead of {right} off."),
    _site("shopcalc", "tax", "tax(price)", "return price * {value} // 100",
          "tax(1000)", lambda v: 10 * v,
          "Tax is computed at {wrong}% but the rate is {right}%."),
    _site("shopcalc", "limits", "max_items()", "return {value}",
          "max_items()", lambda v: v,
          "A basket holds at most {wrong} items; the limit should be {right}."),
    _site("shopcalc", "points", "loyalty_points(spent)", "return spent // {value}",
          "loyalty_points(10000)", lambda v: 10000 // v,
          "One loyalty point is given per {wrong} spent; it should be one per {right}."),
    _site("gridgame", "board", "board_width()", "return {value}",
          "board_width()", lambda v: v,
          "The board is {wrong} cells wide; it should be {right}."),
    _site("gridgame", "lives", "start_lives()", "return {value}",
          "start_lives()", lambda v: v,
          "Players start with {wrong} lives instead of {right}."),
    _site("gridgame", "moves", "move_cost(steps)", "return steps * {value}",
          "move_cost(3)", lambda v: 3 * v,
          "Each step costs {wrong} energy; it should cost {right}."),
    _site("gridgame", "score", "bonus(score)", "return score + {value}",
          "bonus(100)", lambda v: 100 + v,
          "The level bonus adds {wrong} points; it should add {right}."),
    _site("gridgame", "timer", "turn_seconds(level)", "return {value} - level",
          "turn_seconds(1)", lambda v: v - 1,
          "A turn at level 0 lasts {wrong} seconds; it should last {right}."),
    _site("textfmt", "indent", "indent(text)", "return \" \" * {value} + text",
          "len(indent('x'))", lambda v: v + 1,
          "Lines are indented by {wrong} spaces; the indent is {right}."),
    _site("textfmt", "truncate", "truncate(text)", "return text[:{value}]",
          "len(truncate('a' * 200))", lambda v: v,
          "Text is cut after {wrong} characters; the limit is {right}."),
    _site("textfmt", "wrap", "wrap_width()", "return {value}",
          "wrap_width()", lambda v: v,
          "Paragraphs wrap at {wrong} columns instead of {right}."),
    _site("textfmt", "pad", "pad(text)", "return text.ljust({value}, \".\")",
          "len(pad('ab'))", lambda v: max(v, 2),
          "Fields are padded to {wrong} characters; the width is {right}."),
    _site("textfmt", "rule", "rule()", "return \"-\" * {value}",
          "len(rule())", lambda v: v,
          "Horizontal rules are {wrong} dashes long; they should be {right}."),
)
REPOS: tuple[str, ...] = tuple(dict.fromkeys(site.repo for site in SITES))


@dataclass(frozen=True)
class Instance:
    """One generated task: `site` using `wrong` in its base state and `right` when fixed."""

    number: int
    site: Site
    wrong: int
    right: int

    @property
    def instance_id(self) -> str:
        return f"{self.site.repo}__{self.site.module}-{self.number}"


def draw_instances(num_instances: int, seed: int) -> list[Instance]:
    """`num_instances` instances, sites in turn, numbers drawn from `seed`; no two
    instances share a site and both numbers."""
    rng = random.Random(seed)
    instances, seen = [], set()
    while len(instances) < num_instances:
        site = SITES[len(instances) % len(SITES)]
        wrong, right = rng.sample(range(MIN_VALUE, MAX_VALUE + 1), 2)
        if (site.path, wrong, right) in seen or site.expected(wrong) == site.expected(right):
            continue
        seen.add((site.path, wrong, right))
        instances.append(Instance(len(instances) + 1, site, wrong, right))
    return instances


class Numbered(Protocol):
    """An instance of a generated family (this one's or explore_tasks')."""

    @property
    def number(self) -> int: ...


NumberedT = TypeVar("NumberedT", bound=Numbered)


def split_instances(instances: list[NumberedT], heldout_fraction: float,
                    seed: int) -> tuple[list[NumberedT], list[NumberedT]]:
    """(train, held-out): a seeded shuffle of the instances, cut by `heldout_fraction`."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction={heldout_fraction} must be between 0 and 1")
    shuffled = list(instances)
    random.Random(seed + 1).shuffle(shuffled)
    num_heldout = max(1, round(len(shuffled) * heldout_fraction))
    heldout = sorted(shuffled[:num_heldout], key=lambda instance: instance.number)
    train = sorted(shuffled[num_heldout:], key=lambda instance: instance.number)
    return train, heldout


def _module_source(site: Site, value: int) -> str:
    return site.body.format(value=value)


def gold_patch(instance: Instance) -> str:
    """The unified diff (git's headers) from the wrong number to the right one."""
    site = instance.site
    before = _module_source(site, instance.wrong).splitlines(keepends=True)
    after = _module_source(site, instance.right).splitlines(keepends=True)
    hunks = "".join(difflib.unified_diff(before, after, f"a/{site.path}", f"b/{site.path}"))
    return f"diff --git a/{site.path} b/{site.path}\n{hunks}"


def held_back_tests(instance: Instance) -> str:
    """A new test file checking the call's result with the right number."""
    site = instance.site
    path = f"tests/test_issue_{instance.number}.py"
    lines = [f"from {site.repo}.{site.module} import {site.function}\n", "\n", "\n",
             f"def test_{site.function}_uses_{instance.right}():\n",
             f"    assert {site.call} == {site.expected(instance.right)!r}\n"]
    hunk = "".join(f"+{line}" for line in lines)
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n"
            f"+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n{hunk}")


def _example(instance: Instance) -> str:
    site = instance.site
    return (f"```python\n>>> from {site.repo}.{site.module} import {site.function}\n"
            f">>> {site.call}\n{site.expected(instance.wrong)!r}\n```\n\n"
            f"I expected {site.expected(instance.right)!r}.\n")


def _numbers_statement(instance: Instance) -> str:
    site = instance.site
    complaint = site.complaint.format(wrong=instance.wrong, right=instance.right)
    return (f"`{site.function}` in `{site.path}` uses {instance.wrong} instead of "
            f"{instance.right}\n\n{complaint}\n\n{_example(instance)}")


def _line_statement(instance: Instance) -> str:
    site = instance.site
    line = site.body.splitlines()[1]
    before, after = line.format(value=instance.wrong), line.format(value=instance.right)
    return (f"{_numbers_statement(instance)}\nIn `{site.path}` the line `{before.strip()}` "
            f"should read `{after.strip()}`.\n")


def _call_statement(instance: Instance) -> str:
    return f"`{instance.site.function}` gives a wrong result\n\n{_example(instance)}"


# How much of the fix a statement gives away, easiest first: "line" also quotes the line
# before and after; "numbers" names the file and both numbers; "call" only shows one call's
# result and the one expected, so the number must be read off the code and worked out.
DIFFICULTIES: dict[str, Callable[[Instance], str]] = {
    "line": _line_statement, "numbers": _numbers_statement, "call": _call_statement}


def problem_statement(instance: Instance, difficulty: str = "numbers") -> str:
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty={difficulty!r}: choose one of {list(DIFFICULTIES)}")
    return DIFFICULTIES[difficulty](instance)


def write_repository(dest: Path, instance: Instance) -> None:
    """The instance's repository in its FIXED state: every module of its repo (the
    instance's module with the right number, the others with their first draw's)."""
    repo = instance.site.repo
    package = dest / repo
    (dest / "tests").mkdir(parents=True)
    package.mkdir()
    (package / "__init__.py").write_text(f'"""{repo}: a generated learning-benchmark repo."""\n')
    sites = [site for site in SITES if site.repo == repo]
    for site in sites:
        value = instance.right if site is instance.site else MIN_VALUE + len(site.module)
        (package / f"{site.module}.py").write_text(_module_source(site, value))
    imports = "".join(f"import {repo}.{site.module}  # noqa: F401\n" for site in sites)
    (dest / "tests" / "test_core.py").write_text(
        f"{imports}\n\ndef test_every_module_imports():\n    assert {repo}.__name__\n")
    (dest / "pyproject.toml").write_text(
        f'[project]\nname = "{repo}"\nversion = "0.1.0"\n\n'
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["."]\n')


def task_record(instance: Instance, difficulty: str = "numbers") -> dict:
    return {
        "instance_id": instance.instance_id, "repo": f"undertow-learning/{instance.site.repo}",
        "base_commit": "", "problem_statement": problem_statement(instance, difficulty),
        "patch": gold_patch(instance), "test_patch": held_back_tests(instance),
        "FAIL_TO_PASS": [f"tests/test_issue_{instance.number}.py::test_"
                         f"{instance.site.function}_uses_{instance.right}"],
        "PASS_TO_PASS": [CORE_TEST], "image": None, "test_cmd": TEST_CMD,
        "log_parser": "pytest", "timeout_s": 120, "source_dir": f"repos/{instance.instance_id}",
    }


def write_split(folder: Path, instances: list[Instance], difficulty: str = "numbers") -> Path:
    """`folder/tasks.jsonl` and `folder/repos/`, base commits stamped; returns the folder."""
    return write_task_folder(folder, instances, write_repository,
                             lambda instance: task_record(instance, difficulty))


def write_task_folder(folder: Path, instances: list, write_repository: Callable,
                      task_record: Callable) -> Path:
    """A generated family's split in the bundled task format: each instance's repository
    in `folder/repos/<instance_id>/`, its record in `folder/tasks.jsonl`, base commits
    stamped (`explore_tasks.py` writes its splits with it too)."""
    from undertow.sandboxes.taskset import stamp_task_set

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for instance in instances:
        write_repository(folder / "repos" / instance.instance_id, instance)
    lines = [json.dumps(task_record(instance)) for instance in instances]
    (folder / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    stamp_task_set(folder)
    return folder


def generate(out: Path, num_instances: int = 300, seed: int = 0,
             heldout_fraction: float = 0.25, difficulty: str = "numbers") -> tuple[Path, Path]:
    """Writes the train and held-out task sets under `out`; returns their folders."""
    if num_instances < 2:
        raise ValueError(f"num_instances={num_instances}: need at least 2 to split")
    problem_statement(draw_instances(1, seed)[0], difficulty)  # a bad name fails here
    train, heldout = split_instances(draw_instances(num_instances, seed), heldout_fraction, seed)
    return (write_split(out / "train", train, difficulty),
            write_split(out / "heldout", heldout, difficulty))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/learning/tasks"))
    parser.add_argument("--num-instances", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout-fraction", type=float, default=0.25)
    parser.add_argument("--difficulty", default="numbers", choices=list(DIFFICULTIES),
                        help="how much of the fix the statement gives away (DIFFICULTIES)")
    args = parser.parse_args()
    for folder in generate(args.out, args.num_instances, args.seed, args.heldout_fraction,
                           args.difficulty):
        num_tasks = len((folder / "tasks.jsonl").read_text().splitlines())
        print(f"{folder}: {num_tasks} tasks")


if __name__ == "__main__":
    main()
