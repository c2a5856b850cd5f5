"""benchmarks/walks.py: the stop and return counts, the tracer on two tiny modules written
here (the expected walk written by hand), and the import graph of a tiny tree."""

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.import_graph import import_graph, strong_components
from benchmarks.walks import Walk, count_walk

ALPHA = '''
from dataclasses import dataclass

from walkdemo import beta


@dataclass(frozen=True)
class Knob:
    size: int


def helper(number):
    return number + 1


def check(knob):
    return knob.size > 0


def inspect(holder):
    return holder.knob.size


def main():
    knob = Knob(size=helper(1))
    beta.use(knob)
    check(knob)
    holder = beta.Holder(knob)
    holder.finish()
    inspect(holder)
    helper(2)
    beta.train_step()
    check(knob)
'''

BETA = '''
def use(*values, **options):
    from walkdemo import alpha

    return alpha.helper(values[0].size)


class Holder:
    def __init__(self, knob):
        self.knob = knob

    def finish(self):
        return plain(self.knob.size)


def plain(number):
    return number


def train_step():
    return None
'''


@pytest.fixture
def walkdemo(tmp_path, monkeypatch):
    package = tmp_path / "walkdemo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "alpha.py").write_text(ALPHA)
    (package / "beta.py").write_text(BETA)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("walkdemo.alpha")
    for name in [name for name in sys.modules if name.startswith("walkdemo")]:
        del sys.modules[name]


def test_count_collapses_repeats_and_counts_entries_into_modules_left_before():
    walk = count_walk(["cli", "cli", "run", "sections", "run", "run", "learner", "sections"])
    assert walk == {"walk": ["cli", "run", "sections", "run", "learner", "sections"],
                    "stops": 6, "returns": 2}
    assert count_walk([]) == {"walk": [], "stops": 0, "returns": 0}


def test_walk_follows_the_carried_object_from_start_to_end(walkdemo):
    with Walk((walkdemo.Knob,), ("walkdemo.alpha", "main"), ("walkdemo", "train_step"),
              prefix="walkdemo") as walk:
        walkdemo.main()
    # By hand: main (start); Knob.__init__ (self is a Knob; helper(1) before it holds none);
    # beta.use (a Knob in *values; the helper it calls holds none); check; Holder.__init__
    # (the knob an argument); Holder.finish (self holds it; plain does not); inspect (its
    # holder holds it); train_step (the end; the check after it is past the end).
    assert walk.modules == ["walkdemo.alpha", "walkdemo.alpha", "walkdemo.beta",
                            "walkdemo.alpha", "walkdemo.beta", "walkdemo.beta",
                            "walkdemo.alpha", "walkdemo.beta"]
    assert walk.result() == {
        "walk": ["walkdemo.alpha", "walkdemo.beta", "walkdemo.alpha", "walkdemo.beta",
                 "walkdemo.alpha", "walkdemo.beta"],
        "stops": 6, "returns": 4,
        "calls": ["walkdemo.alpha:main", "walkdemo.alpha:Knob.__init__", "walkdemo.beta:use",
                  "walkdemo.alpha:check", "walkdemo.beta:Holder.__init__",
                  "walkdemo.beta:Holder.finish", "walkdemo.alpha:inspect",
                  "walkdemo.beta:train_step"],
        # without finish and inspect, whose arguments only hold the knob
        "direct": {"stops": 4, "returns": 2}}
    assert sys.getprofile() is None


def test_walk_that_never_reaches_its_end_says_so(walkdemo):
    with Walk((walkdemo.Knob,), ("walkdemo.alpha", "main"), ("walkdemo", "absent"),
              prefix="walkdemo") as walk:
        walkdemo.main()
    with pytest.raises(RuntimeError, match="never reached"):
        walk.result()


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_import_graph_of_a_tiny_tree(tmp_path):
    long_body = "".join(f"    x{n} = {n}\n" for n in range(60))
    _write(tmp_path, {
        "undertow/__init__.py": "",
        "undertow/cli.py": "from undertow.learner import train\nimport undertow.config\n",
        "undertow/config.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from undertow.cli import main\n",
        "learner/__init__.py": "",
        "learner/train.py": "def step():\n    from .loop import run\n" + "x = 1\n" * 400,
        "learner/loop.py": f"def run():\n{long_body}",
        "learner/deep/__init__.py": "from undertow.learner.deep import inner\n",
        "learner/deep/inner.py": "from ..train import step\n",
        "learner/tasks/repo.py": "import undertow.cli\n",   # no __init__.py: no module
        "gateway/__init__.py": "", "adapters/__init__.py": "", "sandboxes/__init__.py": "",
    })
    graph = import_graph(tmp_path)
    assert graph["num_modules"] == 11 and graph["num_packages"] == 6
    assert graph["package_edges"]["undertow"] == ["undertow.learner"]
    assert graph["package_edges"]["undertow.learner"] == []
    assert graph["package_edges"]["undertow.learner.deep"] == ["undertow.learner"]
    assert graph["module_cycles"] == [] and graph["package_cycles"] == []
    assert graph["files_over_400_lines"] == [["undertow.learner.train", 402]]
    assert graph["functions_over_60_lines"] == [["undertow.learner.loop.run", 61]]


def test_strong_components_are_the_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"f"},
             "g": set()}
    assert strong_components(graph) == [["a", "b", "c"], ["d", "e"]]
