"""A generated SWE task family that needs exploration: the statement shows a symptom only.

    python -m benchmarks.explore_tasks --out DIR [--num-instances 240] [--num-unseen 64]
                                       [--seed 0] [--heldout-fraction 0.25]
                                       [--difficulty numbers]

Four repositories (`REPOS`) of eleven or more modules each. A repository is a set of
`Chain`s: a public function in one module (`api`) calls a helper in a second module,
which calls a leaf function in a third; the leaf uses a module-level constant. An
instance is a chain and two numbers: in its base state the chain's constant holds the
wrong one. Its statement shows only the symptom, one call of the public function, the
result it gave and the one expected ("numbers" also says which number is used and which
is meant, "constant" also the name of the constant that holds it), never the file or
the function to fix: the agent must find the
chain (grep/ls), read it (cat/sed -n) and edit the constant (sed -i). A decoy makes a
blind edit fail: another chain's constant, in another module, holds the same wrong
number in both states, and a test that is kept passing (PASS_TO_PASS) checks that chain.
Module and constant names say nothing of the public function they serve.

Three repositories are trained on (`ledger`, `orbit`, `quill`, numbers in
[TRAIN_LOW, TRAIN_HIGH]); the fourth (`harbor`) is held out entirely: its names, its
layout (`src/harbor/<subpackage>/`, where the others are flat or one level deep) and its
numbers ([UNSEEN_LOW, UNSEEN_HIGH]) never occur in training. Written in the bundled task
format (`sandboxes/taskset.py`), one folder per split:

    DIR/train/          instances of the three training repositories
    DIR/heldout/        `--num-unseen` instances of the held-out repository
    DIR/heldout-seen/   held-out instances of the three (a seeded `--heldout-fraction`)

each with tasks.jsonl and repos/<instance_id>/ (the FIXED state), base commits stamped,
and oracle.jsonl: each instance's gold session (`oracle_commands`: grep, read the call's
path, sed, submit), which `undertow sft-collect --commands` turns into SFT transcripts.
Output depends only on the arguments: the same seed gives byte-identical folders.
"""

from __future__ import annotations

import argparse
import difflib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from benchmarks.learning_tasks import split_instances, write_task_folder

TRAIN_LOW, TRAIN_HIGH = 3, 99
UNSEEN_LOW, UNSEEN_HIGH = 101, 199
TEST_CMD = "python -m pytest -rA -p no:cacheprovider"
IMPORTS_TEST = "tests/test_core.py::test_every_module_imports"
Item = TypeVar("Item")
# Leaf expressions, each one-to-one in the constant, so two numbers give two results.
OPERATIONS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "mul": ("{x} * {c}", lambda x, c: x * c),
    "add": ("{x} + {c}", lambda x, c: x + c),
    "sub": ("{x} - {c}", lambda x, c: x - c),
    "rsub": ("{c} - {x}", lambda x, c: c - x),
}


@dataclass(frozen=True)
class Chain:
    """`entry(arg)` in `api` -> `helper` in `helper_module` -> `leaf` in `leaf_module`,
    which computes `OPERATIONS[operation]` of its argument and `constant`. Invariant:
    the three modules differ, and no chain of a repository shares a leaf module."""

    entry: str
    arg: int
    helper_module: str
    helper: str
    leaf_module: str
    leaf: str
    constant: str
    operation: str

    def result(self, value: int) -> int:
        return OPERATIONS[self.operation][1](self.arg, value)


@dataclass(frozen=True)
class Repo:
    """A generated repository: `package` under `root` ("" or "src"), every module's
    dotted name (below the package) with its docstring, the chains through them, the
    range its numbers are drawn from, and the names of its public module, its shared
    module and the shared module's two functions (a conversion every helper calls, a
    label every filler module, on no chain, calls). Invariant: `entry_module` and
    `common_module` are keys of `modules`."""

    package: str
    root: str
    modules: dict[str, str]
    chains: tuple[Chain, ...]
    low: int
    high: int
    entry_module: str = "api"
    common_module: str = "common"
    convert: str = "as_amount"
    labeller: str = "label"

    def path(self, module: str) -> str:
        parts = [self.root] if self.root else []
        return "/".join([*parts, self.package, *module.split(".")]) + ".py"

    def dotted(self, module: str) -> str:
        return f"{self.package}.{module}"

    @property
    def public(self) -> str:
        """The dotted name of the module users import the public functions from."""
        return self.dotted(self.entry_module)


def _repo(package: str, root: str, modules: dict[str, str], chains: list[tuple],
          low: int, high: int, *shared: str) -> Repo:
    return Repo(package, root, modules, tuple(Chain(*chain) for chain in chains), low, high,
                *shared)


REPOS: tuple[Repo, ...] = (
    _repo("ledger", "", {
        "api": "Public entry points.", "common": "Small shared conversions.",
        "kit": "Assorted steps.", "rules": "Rule evaluation.", "store": "Record keeping.",
        "flow": "Movement of amounts.", "tables": "Lookup values.", "parts": "Pieces.",
        "units": "Unit handling.", "base": "Base figures.", "notes": "Text output.",
        "audit": "Trails of changes."}, [
        ("monthly_bill", 12, "kit", "settle", "tables", "scaled", "RATE", "mul"),
        ("late_fee", 5, "rules", "apply", "parts", "stepped", "STEP", "mul"),
        ("opening_balance", 40, "store", "open_record", "units", "lifted", "BONUS", "add"),
        ("refund_left", 150, "flow", "after_move", "base", "reduced", "FEE", "sub")],
        TRAIN_LOW, TRAIN_HIGH),
    _repo("orbit", "", {
        "api": "Public entry points.", "common": "Shared helpers.",
        "engine.loop": "The main loop.", "engine.clock": "Time keeping.",
        "engine.state": "Mutable state.", "engine.io": "Input and output.",
        "world.map": "Positions.", "world.tiles": "Tile data.", "world.actors": "Actors.",
        "world.rules": "World rules.", "world.lore": "Names and text."}, [
        ("spawn_health", 3, "engine.loop", "tick", "world.tiles", "weighted", "WEIGHT",
         "mul"),
        ("arena_size", 20, "engine.clock", "advance", "world.actors", "grown", "MARGIN",
         "add"),
        ("shield_left", 200, "engine.state", "update", "world.rules", "drained", "DRAIN",
         "sub"),
        ("fuel_needed", 2, "engine.io", "read_input", "world.map", "spread", "SPREAD",
         "mul")],
        TRAIN_LOW, TRAIN_HIGH),
    _repo("quill", "", {
        "api": "Public entry points.", "common": "Shared helpers.", "lex": "Tokens.",
        "glue": "Joining pieces.", "shape": "Layout.", "marks": "Markers.",
        "store": "Caches.", "spec": "Settings.", "pool": "Reusable values.",
        "trim": "Cutting.", "emit": "Output."}, [
        ("indent_width", 4, "glue", "join_parts", "spec", "widened", "GAP", "mul"),
        ("line_budget", 300, "shape", "fit", "pool", "shortened", "RESERVE", "sub"),
        ("heading_level", 1, "marks", "mark", "trim", "raised", "SHIFT", "add"),
        ("margin_left", 7, "lex", "scan", "store", "opened", "EDGE", "rsub")],
        TRAIN_LOW, TRAIN_HIGH),
    _repo("harbor", "src", {
        "port": "Public entry points.", "tools": "Shared helpers.",
        "dock.berth": "Berths.", "dock.crane": "Cranes.", "dock.tide": "Tides.",
        "dock.log": "Logs.", "yard.stack": "Stacks.", "yard.gate": "Gates.",
        "yard.scale": "Weighing.", "yard.lane": "Lanes.", "yard.sign": "Signage."}, [
        ("berth_fee", 6, "dock.berth", "moor", "yard.stack", "piled", "TIER", "mul"),
        ("crane_reach", 30, "dock.crane", "swing", "yard.gate", "cleared", "CLEARANCE",
         "add"),
        ("cargo_after_toll", 500, "dock.tide", "ebb", "yard.scale", "weighed", "TOLL",
         "sub"),
        ("queue_slack", 9, "dock.log", "entry", "yard.lane", "narrowed", "WIDTH", "rsub")],
        UNSEEN_LOW, UNSEEN_HIGH, "port", "tools", "to_whole", "tag"),
)
TRAIN_REPOS = ("ledger", "orbit", "quill")
UNSEEN_REPO = "harbor"
DIFFICULTIES = ("call", "numbers", "constant")
# The gold sessions' file in each split folder, and their last command: the submit line
# of benchmarks/configs/explore_mini_swe_agent.yaml's step 4.
ORACLE_FILE = "oracle.jsonl"
SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@dataclass(frozen=True)
class Instance:
    """One task: `repo`'s chain `chain` uses `wrong` in its base state and `right` when
    fixed; chain `decoy` holds `wrong` in both; every other chain holds its `others`."""

    number: int
    repo: Repo
    chain: int
    decoy: int
    wrong: int
    right: int
    others: tuple[int, ...]

    @property
    def instance_id(self) -> str:
        return f"{self.repo.package}__issue-{self.number}"

    def values(self, fixed: bool) -> list[int]:
        """Each chain's constant, in the FIXED state or the base state."""
        others = iter(self.others)
        return [(self.right if fixed else self.wrong) if i == self.chain else
                self.wrong if i == self.decoy else next(others)
                for i in range(len(self.repo.chains))]


def draw_instances(repo: Repo, num_instances: int, rng: random.Random,
                   first_number: int = 1) -> list[Instance]:
    """`num_instances` instances of `repo`, its chains in turn, every constant of an
    instance a distinct number of the repo's range; no two instances alike."""
    instances: list[Instance] = []
    seen = set()
    num_chains = len(repo.chains)
    while len(instances) < num_instances:
        chain = len(instances) % num_chains
        decoy = (chain + 1 + rng.randrange(num_chains - 1)) % num_chains
        wrong, right, *others = rng.sample(range(repo.low, repo.high + 1), num_chains + 1)
        if (chain, wrong, right) in seen:
            continue
        seen.add((chain, wrong, right))
        instances.append(Instance(first_number + len(instances), repo, chain, decoy, wrong,
                                  right, tuple(others)))
    return instances


def module_sources(instance: Instance, fixed: bool) -> dict[str, str]:
    """Every file of the package (path -> text), chains' constants per `values(fixed)`."""
    repo = instance.repo
    sources = {repo.path(module): f'"""{repo.package}: {doc}"""\n'
               for module, doc in repo.modules.items()}
    common = repo.dotted(repo.common_module)
    sources[repo.path(repo.common_module)] += (
        f"\n\ndef {repo.convert}(value):\n    return int(value)\n\n\n"
        f"def {repo.labeller}(name, value):\n    return f\"{{name}}: {{value}}\"\n")
    entry_imports, entry_functions = [], []
    for chain, value in zip(repo.chains, instance.values(fixed), strict=True):
        expression = OPERATIONS[chain.operation][0].format(x="amount", c=chain.constant)
        sources[repo.path(chain.leaf_module)] += (
            f"\n{chain.constant} = {value}\n\n\ndef {chain.leaf}(amount):\n"
            f"    return {expression}\n")
        sources[repo.path(chain.helper_module)] += (
            f"\nfrom {common} import {repo.convert}\n"
            f"from {repo.dotted(chain.leaf_module)} import {chain.leaf}\n\n\n"
            f"def {chain.helper}(amount):\n    return {repo.convert}({chain.leaf}(amount))\n")
        entry_imports.append(f"from {repo.dotted(chain.helper_module)} import {chain.helper}\n")
        entry_functions.append(f"\n\ndef {chain.entry}(amount):\n"
                               f"    return {chain.helper}(amount)\n")
    sources[repo.path(repo.entry_module)] += ("\n" + "".join(sorted(entry_imports))
                                              + "".join(entry_functions))
    used = {repo.entry_module, repo.common_module} | \
        {c.helper_module for c in repo.chains} | {c.leaf_module for c in repo.chains}
    for module in repo.modules:
        if module not in used:
            name = module.split(".")[-1]
            sources[repo.path(module)] += (
                f"\nfrom {common} import {repo.labeller}\n\n\n"
                f"def describe_{name}(value):\n    return {repo.labeller}(\"{name}\", value)\n")
    return sources


def gold_patch(instance: Instance) -> str:
    """The unified diff (git's headers) from the wrong number to the right one."""
    path = instance.repo.path(instance.repo.chains[instance.chain].leaf_module)
    before = module_sources(instance, fixed=False)[path].splitlines(keepends=True)
    after = module_sources(instance, fixed=True)[path].splitlines(keepends=True)
    hunks = "".join(difflib.unified_diff(before, after, f"a/{path}", f"b/{path}"))
    return f"diff --git a/{path} b/{path}\n{hunks}"


def held_back_tests(instance: Instance) -> str:
    """A new test file checking the call's result with the right number."""
    chain = instance.repo.chains[instance.chain]
    path = f"tests/test_issue_{instance.number}.py"
    lines = [f"from {instance.repo.public} import {chain.entry}\n", "\n", "\n",
             f"def test_issue_{instance.number}():\n",
             f"    assert {chain.entry}({chain.arg}) == {chain.result(instance.right)}\n"]
    hunk = "".join(f"+{line}" for line in lines)
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n"
            f"+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n{hunk}")


def problem_statement(instance: Instance, difficulty: str = "numbers") -> str:
    """The symptom: one call, its result and the expected one ("numbers": and which
    number is used where which is meant; "constant": and the constant's name, which
    tells its grep hit from the decoy's). Never a file, function or line of the fix."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty={difficulty!r}: choose one of {list(DIFFICULTIES)}")
    chain = instance.repo.chains[instance.chain]
    text = (f"`{chain.entry}` gives a wrong result\n\n```python\n"
            f">>> from {instance.repo.public} import {chain.entry}\n"
            f">>> {chain.entry}({chain.arg})\n{chain.result(instance.wrong)}\n```\n\n"
            f"I expected {chain.result(instance.right)}.\n")
    if difficulty in ("numbers", "constant"):
        text += (f"\nSomewhere on the way the number {instance.wrong} is used where "
                 f"{instance.right} is meant.\n")
    if difficulty == "constant":
        text += f"The constant that holds it is named {chain.constant}.\n"
    return text


def decoy_test_name(instance: Instance) -> str:
    return f"test_{instance.repo.chains[instance.decoy].entry}"


def write_repository(dest: Path, instance: Instance) -> None:
    """The instance's repository in its FIXED state, with tests/test_core.py: every
    module imports, and each chain but the instance's gives its result."""
    repo = instance.repo
    for path, text in module_sources(instance, fixed=True).items():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_text(text)
    package_dir = dest / repo.path(repo.entry_module).rsplit("/", 1)[0]
    for folder in [package_dir, *(p for p in package_dir.rglob("*") if p.is_dir())]:
        init = folder / "__init__.py"
        if not init.exists():
            init.write_text(f'"""{folder.name}: part of {repo.package}."""\n')
    imports = "".join(f"import {repo.dotted(module)}  # noqa: F401\n"
                      for module in repo.modules)
    tests = [f"\n\ndef test_every_module_imports():\n    assert {repo.package}.__name__\n"]
    values = instance.values(fixed=True)
    for i, chain in enumerate(repo.chains):
        if i != instance.chain:
            tests.append(f"\n\ndef test_{chain.entry}():\n    from {repo.public} "
                         f"import {chain.entry}\n\n"
                         f"    assert {chain.entry}({chain.arg}) == {chain.result(values[i])}\n")
    (dest / "tests").mkdir()
    (dest / "tests" / "test_core.py").write_text(imports + "".join(tests))
    pythonpath = repo.root or "."
    (dest / "pyproject.toml").write_text(
        f'[project]\nname = "{repo.package}"\nversion = "0.1.0"\n\n'
        f'[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["{pythonpath}"]\n')


def task_record(instance: Instance, difficulty: str = "numbers") -> dict:
    return {
        "instance_id": instance.instance_id, "repo": f"undertow-explore/{instance.repo.package}",
        "base_commit": "", "problem_statement": problem_statement(instance, difficulty),
        "patch": gold_patch(instance), "test_patch": held_back_tests(instance),
        "FAIL_TO_PASS": [f"tests/test_issue_{instance.number}.py::test_issue_{instance.number}"],
        "PASS_TO_PASS": [IMPORTS_TEST, f"tests/test_core.py::{decoy_test_name(instance)}"],
        "image": None, "test_cmd": TEST_CMD, "log_parser": "pytest", "timeout_s": 120,
        "source_dir": f"repos/{instance.instance_id}",
    }


def oracle_commands(instance: Instance, testbed: str = "/testbed") -> list[str]:
    """The gold session, one shell command a reply, as a careful agent runs it: search for
    the wrong number (the chain's constant and the decoy both show), read the public
    module (which helper the call goes through) and the helper's module (which leaf module
    it imports: one of the two hits), fix that module's constant, submit. Each command's
    output holds what the next one needs, so a policy that imitates it learns to read
    before it edits, not where the fix is."""
    repo, chain = instance.repo, instance.repo.chains[instance.chain]
    leaf = f"{testbed}/{repo.path(chain.leaf_module)}"
    return [f"grep -rn {instance.wrong} {testbed} --include=*.py",
            f"cat {testbed}/{repo.path(repo.entry_module)}",
            f"cat {testbed}/{repo.path(chain.helper_module)}",
            f"sed -i 's/{chain.constant} = {instance.wrong}/{chain.constant} = "
            f"{instance.right}/' {leaf}",
            SUBMIT_COMMAND]


def write_split(folder: Path, instances: list[Instance], difficulty: str = "numbers") -> Path:
    """`folder/tasks.jsonl` and `folder/repos/`, base commits stamped, and
    `folder/oracle.jsonl` (`undertow sft-collect --commands`: each instance's
    `oracle_commands`); returns the folder."""
    write_task_folder(folder, instances, write_repository,
                      lambda instance: task_record(instance, difficulty))
    (folder / ORACLE_FILE).write_text("".join(
        json.dumps({"instance_id": i.instance_id, "commands": oracle_commands(i)}) + "\n"
        for i in instances))
    return folder


def draw_splits(num_instances: int, num_unseen: int, seed: int,
                heldout_fraction: float) -> dict[str, list[Instance]]:
    """The instances of each split: the training repositories' `num_instances` cut into
    train and heldout-seen, and `num_unseen` of the held-out repository."""
    rng = random.Random(seed)
    repos = {repo.package: repo for repo in REPOS}
    seen: list[Instance] = []
    for name in TRAIN_REPOS:
        count = num_instances // len(TRAIN_REPOS) + (name == TRAIN_REPOS[0]) * (
            num_instances % len(TRAIN_REPOS))
        seen += draw_instances(repos[name], count, rng, first_number=len(seen) + 1)
    train, heldout_seen = split_instances(seen, heldout_fraction, seed)
    unseen = draw_instances(repos[UNSEEN_REPO], num_unseen, rng, first_number=len(seen) + 1)
    return {"train": interleave_repositories(train), "heldout": unseen,
            "heldout-seen": interleave_repositories(heldout_seen)}


def interleave_repositories(instances: list[Instance]) -> list[Instance]:
    """One instance of each repository in turn: the first N of a split (`undertow rollout
    num_tasks=N`) span every repository."""
    return in_turn(instances, lambda instance: instance.repo.package)


def in_turn(items: list[Item], key: Callable[[Item], str]) -> list[Item]:
    """The first item of each `key` (in order of first appearance), then the second of
    each, and so on; each key's items keep their order."""
    by_key: dict[str, list[Item]] = {}
    for item in items:
        by_key.setdefault(key(item), []).append(item)
    return [group[i] for i in range(max(map(len, by_key.values()), default=0))
            for group in by_key.values() if i < len(group)]


def generate(out: Path, num_instances: int = 240, num_unseen: int = 64, seed: int = 0,
             heldout_fraction: float = 0.25, difficulty: str = "numbers") -> dict[str, Path]:
    """Writes the three splits under `out`; returns their folders by split name."""
    if num_instances < 2 * len(TRAIN_REPOS) or num_unseen < 1:
        raise ValueError(f"num_instances={num_instances}, num_unseen={num_unseen}: need at "
                         f"least {2 * len(TRAIN_REPOS)} training-repository instances and "
                         "1 of the held-out repository")
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty={difficulty!r}: choose one of {list(DIFFICULTIES)}")
    splits = draw_splits(num_instances, num_unseen, seed, heldout_fraction)
    return {name: write_split(out / name, instances, difficulty)
            for name, instances in splits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/learning-explore/tasks"))
    parser.add_argument("--num-instances", type=int, default=240,
                        help="of the three training repositories (train + heldout-seen)")
    parser.add_argument("--num-unseen", type=int, default=64,
                        help="of the held-out repository")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout-fraction", type=float, default=0.25)
    parser.add_argument("--difficulty", default="numbers", choices=DIFFICULTIES,
                        help="call: the call's results only; numbers: also the two numbers; "
                        "constant: also the constant's name")
    args = parser.parse_args()
    folders = generate(args.out, args.num_instances, args.num_unseen, args.seed,
                       args.heldout_fraction, args.difficulty)
    for folder in folders.values():
        num_tasks = len((folder / "tasks.jsonl").read_text().splitlines())
        print(f"{folder}: {num_tasks} tasks")


if __name__ == "__main__":
    main()
