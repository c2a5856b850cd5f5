"""Walks: a run config and a chat call's sampling parameters followed through the calls, and
the import graph, on the code before issue 39's moves and after, side by side.

    python -m benchmarks.walks [--before 7cf1793] [--after HEAD]

`--after .` measures this checkout's working tree as it is (uncommitted changes too).

Each commit is checked out as a git worktree (`/tmp/walks-<commit>`), with a package root
beside it whose `undertow/` links that tree's `undertow/*`, `gateway`, `adapters`, `learner`
and `sandboxes` (as `make lint` builds one for pyright). The walks run in a subprocess with
that root as its working directory and first on PYTHONPATH, so `undertow.*` is that commit's
(checked: `undertow.gateway.__file__` must lie in the root), and so are the built-in engine
processes it launches (`python -m undertow.cli ...` from the same working directory).

A walk is measured by running the real thing under `sys.setprofile`, on one thread: every
Python call (a coroutine or generator resumed counts as a call) in an `undertow.*` module
whose arguments hold a carried object. An argument (`self`, `cls` and each item of `*args`
and `**kwargs` included) holds it when it is one (by type), or when its instance `__dict__`
has one as a direct value (a `RolloutContext` holding the `rollout` section; one level only).
A call's module is its function's globals' `__name__` (a dataclass's generated `__init__`
belongs to the class's module). The walk is the start's module, the modules of the calls
that hold the object, in order, and the end's module; consecutive repeats collapsed. Its
*stops* are the modules entered (the length of that sequence), its *returns* the entries
into a module already left earlier (stops minus distinct modules). `direct` counts them
again with only the calls one of whose arguments is a carried object itself.

- (a) run config: `undertow.cli.main(["train", ...])` in process (the tiny model of seed 0,
  the default `chat` tasks, `TRAIN_OPTIONS`: one step of one group of 2, one warm-start step,
  and `advantages.filter_uniform_groups=false`, so that the walk does not depend on the
  rewards sampled), on the main thread (the learner's and the loop's; the gateway and the
  rollouts on the background loop are not followed). Carried: `RunSections` and its fields'
  dataclasses (the sections). From `main` in `undertow.cli` to the first call named
  `train_step` in `undertow.learner`.
- (b) sampling parameters: an embedded gateway (`embedded_gateway`) in front of the
  built-in engine on the tiny model; after one untraced call in another session, one chat
  call (`openai.AsyncOpenAI`, 4 tokens) in a fresh session, traced on the event loop's
  thread. Carried: `SamplingParams`. From the API handler (`chat_completions` in
  `undertow.gateway.front`) to the driver writing the parameters into its engine request
  (`sglang_sampling_params` in `undertow.gateway`), both looked up by name.

The import graph and the sizes are read from each checkout's sources
(`benchmarks/import_graph.py`).

Writes `benchmarks/results/walks.json` (each walk's modules and calls too) and prints a
Markdown table.
"""

import argparse
import asyncio
import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import FrameType, ModuleType

from benchmarks.import_graph import FOLDERS, LONG_FILE_LINES, LONG_FUNCTION_LINES, import_graph

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "walks.json"
BEFORE = "7cf1793"   # the last commit before issue 39's moves
TRAIN_OPTIONS = ("learner.num_steps=1", "learner.group_size=2", "warm_start.num_steps=1",
                 "rollout.concurrency=2", "advantages.filter_uniform_groups=false")
CO_VARARGS, CO_VARKEYWORDS = 0x04, 0x08
WORKING_TREE = "."


def collapse(modules: Iterable[str]) -> list[str]:
    """`modules` with consecutive repeats collapsed into one."""
    collapsed: list[str] = []
    for module in modules:
        if not collapsed or collapsed[-1] != module:
            collapsed.append(module)
    return collapsed


def count_walk(modules: Iterable[str]) -> dict:
    """Stops (modules entered) and returns (entries into a module already left)."""
    walk = collapse(modules)
    return {"stops": len(walk), "returns": len(walk) - len(set(walk)), "walk": walk}


def holds(value: object, carried: tuple[type, ...]) -> bool:
    """Whether `value` is a carried object or holds one as a direct instance attribute."""
    if isinstance(value, carried):
        return True
    if isinstance(value, (type, ModuleType)):
        return False
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except AttributeError:
        return False
    return isinstance(attributes, dict) and any(
        isinstance(item, carried) for item in list(attributes.values()))


def arguments(frame: FrameType) -> list[object]:
    """The values of a called frame's arguments, each item of `*args`/`**kwargs` apart."""
    code = frame.f_code
    num_named = code.co_argcount + code.co_kwonlyargcount
    local = frame.f_locals
    values: list[object] = [local.get(name) for name in code.co_varnames[:num_named]]
    index = num_named
    if code.co_flags & CO_VARARGS:
        values.extend(local.get(code.co_varnames[index]) or ())
        index += 1
    if code.co_flags & CO_VARKEYWORDS:
        values.extend((local.get(code.co_varnames[index]) or {}).values())
    return values


class Walk:
    """Follows `carried` objects through the calls of the thread it is installed on, in
    modules under `prefix`, from the first call of `start` to the first of `end` (each a
    (module prefix, function name) pair): `modules` is the raw sequence, `calls` the
    functions (`module:qualified name`), `direct` whether an argument is a carried object
    itself (the start and the end count as such)."""

    def __init__(self, carried: tuple[type, ...], start: tuple[str, str],
                 end: tuple[str, str], prefix: str = "undertow"):
        self.carried, self.start, self.end, self.prefix = carried, start, end, prefix
        self.modules: list[str] = []
        self.calls: list[str] = []
        self.direct: list[bool] = []
        self.started = self.ended = False

    def __enter__(self) -> "Walk":
        sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.setprofile(None)

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or self.ended:
            return
        module = frame.f_globals.get("__name__", "")
        if module != self.prefix and not module.startswith(self.prefix + "."):
            return
        name, direct = frame.f_code.co_name, True
        if not self.started:
            self.started = _matches(module, name, self.start)
            if not self.started:
                return
        elif _matches(module, name, self.end):
            self.ended = True
            sys.setprofile(None)
        else:
            values = arguments(frame)
            if not any(holds(value, self.carried) for value in values):
                return
            direct = any(isinstance(value, self.carried) for value in values)
        self.modules.append(module)
        self.calls.append(f"{module}:{call_name(frame)}")
        self.direct.append(direct)

    def result(self) -> dict:
        if not self.ended:
            raise RuntimeError(f"the walk never reached {self.end} (started: {self.started}); "
                               "did the run fail before it, or was the function renamed?")
        direct = count_walk(m for m, d in zip(self.modules, self.direct, strict=True) if d)
        return {**count_walk(self.modules), "calls": collapse(self.calls),
                "direct": {"stops": direct["stops"], "returns": direct["returns"]}}


def call_name(frame: FrameType) -> str:
    """The function's qualified name; a dataclass's generated method by its class."""
    code = frame.f_code
    if "__create_fn__" in code.co_qualname and code.co_argcount:
        return f"{type(frame.f_locals.get(code.co_varnames[0])).__qualname__}.{code.co_name}"
    return code.co_qualname


def _matches(module: str, name: str, target: tuple[str, str]) -> bool:
    return name == target[1] and (module == target[0] or module.startswith(target[0] + "."))


def first_attribute(candidates: Sequence[str], name: str) -> type:
    """`name` from the first importable module of `candidates` (one per tree)."""
    for module_name in candidates:
        try:
            return getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
    raise RuntimeError(f"{name} is in none of {list(candidates)}; add its new module here")


def section_types() -> tuple[type, ...]:
    """`RunSections` and the dataclass of each of its sections."""
    run_sections = first_attribute(
        ("undertow.run.sections", "undertow.run_sections", "undertow.run.train"), "RunSections")
    found = [run_sections]
    for hint in typing.get_type_hints(run_sections).values():
        found += [t for t in (hint, *typing.get_args(hint))
                  if isinstance(t, type) and dataclasses.is_dataclass(t)]
    return tuple(found)


# Undertow is imported inside the functions that the measuring process runs: there it is
# the measured commit's; this checkout's is never needed.


def walk_run_config(model_dir: Path, work_dir: Path) -> dict:
    """Walk (a): `undertow train` in this process, one step."""
    from undertow.cli import main

    carried = section_types()
    argv = ["train", "--run-dir", str(work_dir / "run"), f"run.model_dir={model_dir}",
            *TRAIN_OPTIONS]
    with Walk(carried, ("undertow.cli", "main"), ("undertow.learner", "train_step")) as walk:
        code = main(argv)
    if code not in (0, None):
        raise RuntimeError(f"undertow train exited {code}; its output is above")
    return {**walk.result(), "argv": argv, "carried": [t.__name__ for t in carried]}


async def walk_sampling(model_dir: Path, work_dir: Path) -> dict:
    """Walk (b): one chat call through the embedded gateway to the built-in engine."""
    import httpx  # here, not above: a second of CPU the unit tests need not pay
    import openai

    work_dir.mkdir(parents=True, exist_ok=True)   # the engine's log goes there
    embedded_gateway = first_attribute(("undertow.run.embedded", "undertow.embedded"),
                                       "embedded_gateway")
    carried = (first_attribute(
        ("undertow.gateway.engines.protocol", "undertow.gateway.front.call_types"),
        "SamplingParams"),)
    async with embedded_gateway(model_dir, work_dir / "store") as gateway, \
            httpx.AsyncClient() as http:
        async def chat_call(group: str) -> None:
            reply = await http.post(f"{gateway.url}/admin/sessions", json={"group": group},
                                    headers={"Authorization": f"Bearer {gateway.admin_token}"})
            reply.raise_for_status()
            session = reply.json()
            async with openai.AsyncOpenAI(base_url=session["base_url"],
                                          api_key=session["api_key"], max_retries=0) as client:
                await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4)

        await chat_call("warm-up")
        with Walk(carried, ("undertow.gateway.front", "chat_completions"),
                  ("undertow.gateway", "sglang_sampling_params")) as walk:
            await chat_call("walked")
    return {**walk.result(), "carried": [t.__name__ for t in carried]}


def measure_walks(root: Path, out: Path) -> None:
    """Both walks in this process, on the tree whose package root is `root`."""
    import undertow.gateway
    from undertow.learner.modeldir import init_model_dir

    where = Path(undertow.gateway.__file__)
    if not where.is_relative_to(root):
        raise RuntimeError(f"undertow.gateway imports from {where}, not from {root}")
    work_dir = Path(tempfile.mkdtemp(prefix="walks-run-"))
    try:
        model_dir = init_model_dir(work_dir / "tiny", size="tiny", seed=0)
        sampling = asyncio.run(walk_sampling(model_dir, work_dir / "chat"))
        run_config = walk_run_config(model_dir, work_dir / "train")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    out.write_text(json.dumps({"run_config": run_config, "sampling": sampling,
                               "imports_from": str(where)}, indent=1))


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def check_out(commit: str) -> tuple[Path, Path]:
    """A worktree of `commit` and a package root of links to it (its `undertow/`);
    `WORKING_TREE` is this checkout itself."""
    if commit == WORKING_TREE:
        return REPO, _package_root(REPO, Path(tempfile.mkdtemp(prefix="walks-working-")))
    checkout = Path(tempfile.gettempdir()) / f"walks-{commit[:7]}"
    if not checkout.exists():
        git("worktree", "add", "--detach", str(checkout), commit)
    found = git("-C", str(checkout), "rev-parse", "HEAD")
    if found != commit:
        raise RuntimeError(f"{checkout} holds {found}, not {commit}; remove it with "
                           f"`git worktree remove --force {checkout}` and run again")
    return checkout, _package_root(checkout, checkout.parent / f"walks-{commit[:7]}-root")


def _package_root(checkout: Path, root: Path) -> Path:
    """`root`, holding an `undertow/` of links to `checkout`'s packages (made once; a
    folder left part-made by a run cut short is made again)."""
    package = root / "undertow"
    if not (package / "gateway").exists():
        shutil.rmtree(package, ignore_errors=True)
        package.mkdir(parents=True)
        for entry in (checkout / "undertow").iterdir():
            (package / entry.name).symlink_to(entry)
        for folder in set(FOLDERS.values()) - {"undertow"}:
            (package / folder).symlink_to(checkout / folder)
    return root


# The measuring process: its working directory, the package root, comes first on sys.path
# (`undertow`), this checkout last (`benchmarks` only: its `undertow/` is never reached).
RUNNER = ("import sys; sys.path.append(sys.argv[1]); from benchmarks.walks import main; "
          "sys.exit(main(sys.argv[2:]))")


def measure_commit(commit: str) -> dict:
    """Both walks of `commit` in a subprocess on its tree, and its import graph."""
    checkout, root = check_out(commit)
    out = Path(tempfile.mkstemp(prefix="walks-", suffix=".json")[1])
    env = {**os.environ, "PYTHONPATH": str(root), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    started_s = time.monotonic()
    subprocess.run([sys.executable, "-c", RUNNER, str(REPO), "--measure", str(root),
                    "--out", str(out)], check=True, cwd=root, env=env)
    walks = json.loads(out.read_text())
    out.unlink()
    subject = ("the working tree" if commit == WORKING_TREE
               else git("log", "-1", "--format=%s", commit))
    return {"commit": commit, "subject": subject,
            "walk_s": round(time.monotonic() - started_s, 1), **walks,
            "imports": import_graph(checkout)}


def table(before: dict, after: dict) -> str:
    """The Markdown table, before and after side by side."""
    def imports(key: str) -> Callable[[dict], object]:
        return lambda tree: tree["imports"][key]

    rows: list[tuple[str, Callable[[dict], object]]] = [
        ("(a) run config, `main` to `train_step`: stops", lambda t: t["run_config"]["stops"]),
        ("(a) returns", lambda t: t["run_config"]["returns"]),
        ("(a) stops / returns, arguments that are a section only",
         lambda t: "{stops} / {returns}".format(**t["run_config"]["direct"])),
        ("(b) sampling parameters, API handler to driver: stops",
         lambda t: t["sampling"]["stops"]),
        ("(b) returns", lambda t: t["sampling"]["returns"]),
        ("(b) stops / returns, arguments that are the parameters only",
         lambda t: "{stops} / {returns}".format(**t["sampling"]["direct"])),
        ("modules", imports("num_modules")),
        ("packages", imports("num_packages")),
        ("import edges between packages", imports("num_package_edges")),
        ("import cycles, modules / packages", lambda t: "{} / {}".format(
            len(t["imports"]["module_cycles"]), len(t["imports"]["package_cycles"]))),
        ("lines", imports("num_lines")),
        (f"files over {LONG_FILE_LINES} lines",
         lambda t: len(t["imports"]["files_over_400_lines"])),
        (f"functions over {LONG_FUNCTION_LINES} lines",
         lambda t: len(t["imports"]["functions_over_60_lines"])),
    ]
    lines = [f"| | before ({before['commit'][:7]}) | after ({after['commit'][:7]}) |",
             "|---|---:|---:|"]
    lines += [f"| {name} | {value(before)} | {value(after)} |" for name, value in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help="commit before the change")
    parser.add_argument("--after", default="HEAD", help="commit after the change")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--measure", type=Path, default=None,
                        help=argparse.SUPPRESS)   # the measuring subprocess: its package root
    args = parser.parse_args(argv)
    if args.measure is not None:
        measure_walks(args.measure, args.out)
        return 0
    commits = {name: commit if commit == WORKING_TREE else git("rev-parse", commit)
               for name, commit in (("before", args.before), ("after", args.after))}
    trees = {name: measure_commit(commit) for name, commit in commits.items()}
    result = {"command": " ".join(["python -m benchmarks.walks", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **trees}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(trees["before"], trees["after"]))
    for name, tree in trees.items():
        for walk in ("run_config", "sampling"):
            print(f"\n{name} {walk}: " + " -> ".join(tree[walk]["walk"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
