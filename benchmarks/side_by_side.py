"""Side by side: one benchmark command run on the code of several commits, in rounds.

    python -m benchmarks.side_by_side OLD_COMMIT NEW_COMMIT [--rounds 2] [--keys REGEX]
        -- -m benchmarks.learner --shapes scaled --methods tree,per_session

Each commit's tree is exported (`gateway_ab.export`: `git archive`, and a package root whose
`undertow` is that tree; here the root also links the tree's `benchmarks`) and the command
runs as `python COMMAND` in the package root, so `benchmarks.*` and `undertow.*` are that
commit's, in this virtualenv. The root also holds a `sitecustomize.py` that drops the
editable install's import hook at start-up, so the benchmark's own worker processes load
the same commit's code. Within a round the commits take turns (the first commit goes first in odd
rounds, last in even ones), so load on the shared machine hits every commit alike.

Each run's results JSON (the command's `benchmarks/results/NAME.json`, `--results NAME`)
is copied to `--out`, and every number in it whose path matches `--keys` is printed per
commit and round, with its ratio to the first commit's in the same round: compare within
a run.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.gateway_ab import DROP_EDITABLE_HOOK, export


def numbers(value, path: str = ""):
    """(path, number) for every number in a JSON value, paths like `rows/0/step_cpu_s`;
    a row with a `method` or `name` is named by it (`rows/tree/step_cpu_s`)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from numbers(item, f"{path}/{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            name = index
            if isinstance(item, dict):
                name = "-".join(str(item[k]) for k in ("method", "shape", "name") if k in item)
            yield from numbers(item, f"{path}/{name or index}")
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield path.lstrip("/"), float(value)


def run_once(root: Path, command: list[str], results: str, out: Path) -> dict[str, float]:
    tree = (root / "benchmarks").resolve().parent
    completed = subprocess.run([sys.executable, *command], cwd=root, text=True,
                               env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True)
    print(completed.stdout[-3000:], flush=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{command} failed in {tree}:\n{completed.stderr[-3000:]}")
    produced = tree / "benchmarks" / "results" / f"{results}.json"
    shutil.copy(produced, out)
    return dict(numbers(json.loads(produced.read_text())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commits", nargs="+")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--results", default="learner", help="the results JSON's name")
    parser.add_argument("--keys", default="step_cpu_s|peak_step_mib",
                        help="a regex: the result paths to print")
    parser.add_argument("--out", default="benchmarks/results/side_by_side")
    args, command = parser.parse_known_args()
    command = [c for c in command if c != "--"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="undertow-sbs-") as work:
        roots = {commit: export(commit, Path(work)) for commit in args.commits}
        for commit, root in roots.items():
            (root / "sitecustomize.py").write_text(DROP_EDITABLE_HOOK + "\n")
            (root / "benchmarks").symlink_to(Path(work) / commit / "benchmarks")
        for round_number in range(1, args.rounds + 1):
            order = args.commits if round_number % 2 else args.commits[::-1]
            figures = {c: run_once(roots[c], command, args.results,
                                   out / f"{args.results}-{c}-round{round_number}.json")
                       for c in order}
            print_round(round_number, args.commits, figures, re.compile(args.keys))


def print_round(round_number: int, commits: list[str], figures: dict, keys: re.Pattern) -> None:
    base = figures[commits[0]]
    print(f"\nround {round_number}\n\n| result | " + " | ".join(commits) + " |")
    print("|---|" + "---:|" * len(commits))
    for path in sorted(p for p in base if keys.search(p)):
        cells = [f"{base[path]:.4g}"]
        for commit in commits[1:]:
            value = figures[commit].get(path)
            cells.append("-" if value is None else
                         f"{value:.4g} ({value / base[path]:.2f}x)" if base[path] else
                         f"{value:.4g}")
        print(f"| {path} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
