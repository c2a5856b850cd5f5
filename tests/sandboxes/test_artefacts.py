"""Build artefacts (`sandboxes/artefacts.py`): the patterns read for a path as git reads
them in the diff, with git itself as the reference."""

import subprocess

from undertow.sandboxes.artefacts import BUILD_ARTEFACTS, is_build_artefact

PATHS = ["pkg/__pycache__/mod.cpython-311.pyc", "__pycache__/a.pyc", "top.pyc", "deep/a/b.pyo",
         ".pytest_cache/v/cache/nodeids", "src/pkg.egg-info/PKG-INFO", ".coverage",
         ".coverage.host.1", "pkg/.mypy_cache/3.11/x.json", ".tox/py311/bin/python",
         "Foo$py.class", "pkg/mod.py", "pycache.py", "docs/__pycache__", "egg-info.py",
         "src/pkg.egg-info", "tests/test_pyc.py", "notes/coverage.txt", "a.pyx",
         "pytest_cache/readme"]


def test_paths_match_as_git_ignores_them(tmp_path):
    git = {"cwd": tmp_path, "capture_output": True, "text": True}
    subprocess.run(["git", "init", "-q"], check=True, **git)
    (tmp_path / ".gitignore").write_text("".join(p + "\n" for p in BUILD_ARTEFACTS))
    checked = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"],
                             input="".join(p + "\n" for p in PATHS), **git)
    ignored = set(checked.stdout.split())
    assert {p for p in PATHS if is_build_artefact(p)} == ignored
    assert "pkg/mod.py" not in ignored and "pkg/__pycache__/mod.cpython-311.pyc" in ignored
