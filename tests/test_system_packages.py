"""The guard: every external program the code calls is installed by the set-up.

The code's calls are found by reading its syntax trees: a `subprocess` call or
`asyncio.create_subprocess_exec` whose program is a literal, and `shutil.which` of a
literal. Each program must be in `system-packages.txt`, the one list that `make
system-packages` installs from, unless the Python or npm set-up provides it.
"""

import ast
import subprocess
from pathlib import Path

from undertow.doctor import read_system_packages

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("gateway", "adapters", "learner", "sandboxes", "undertow", "benchmarks", "tests")
SUBPROCESS_CALLS = {"run", "Popen", "call", "check_call", "check_output"}
# Programs that the virtualenvs or the npm set-up (`make setup-agents`) provide.
PROVIDED_BY_SETUP = {"python", "python3", "pip", "claude", "codex", "ruff", "pytest"}


def _literal_program(node: ast.expr) -> str | None:
    if isinstance(node, ast.List | ast.Tuple) and node.elts:
        node = node.elts[0]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip():
        return node.value.split()[0]
    return None


def called_programs(source: str) -> set[str]:
    """The literal program names that `source` runs or looks up on the PATH."""
    programs = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        function = node.func
        name = function.attr if isinstance(function, ast.Attribute) else getattr(
            function, "id", "")
        owner = getattr(function.value, "id", "") if isinstance(function, ast.Attribute) else ""
        runs = ((name in SUBPROCESS_CALLS and owner == "subprocess")
                or name in ("create_subprocess_exec", "which"))
        program = _literal_program(node.args[0]) if runs else None
        if program is not None:
            programs.add(Path(program).name)
    return programs


def programs_in_code() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "tasks" in path.relative_to(REPO).parts[:2]:  # task repositories run in sandboxes
                continue
            for program in called_programs(path.read_text()):
                found.setdefault(program, []).append(str(path.relative_to(REPO)))
    return found


def not_installed(found: dict[str, list[str]], listed: dict[str, str]) -> dict[str, list[str]]:
    return {program: paths for program, paths in found.items()
            if program not in listed and program not in PROVIDED_BY_SETUP}


def test_every_program_the_code_calls_is_installed_by_the_setup():
    found = programs_in_code()
    assert {"docker", "dockerd", "debootstrap", "git", "tar"} <= set(found), found
    missing = not_installed(found, read_system_packages())
    assert missing == {}, f"add these to system-packages.txt (program package): {missing}"


def test_the_guard_fails_when_debootstrap_leaves_the_list():
    listed = read_system_packages()
    del listed["debootstrap"]
    missing = not_installed(programs_in_code(), listed)
    assert set(missing) == {"debootstrap"}
    assert "sandboxes/base_image.py" in missing["debootstrap"]


def test_the_scan_sees_each_way_of_calling_a_program():
    source = """
import asyncio, shutil, subprocess
subprocess.run(["alpha", "-x"])
subprocess.Popen(("beta",))
subprocess.check_output("gamma --flag", shell=True)
asyncio.create_subprocess_exec("delta", "arg")
shutil.which("epsilon")
subprocess.run([program_name])
"""
    assert called_programs(source) == {"alpha", "beta", "gamma", "delta", "epsilon"}


def test_make_system_packages_installs_from_the_list_and_setup_runs_it():
    makefile = (REPO / "Makefile").read_text()
    assert "system-packages.txt" in makefile
    assert any(line.startswith("setup: system-packages") for line in makefile.splitlines())
    # With every listed program present, the target has nothing to install.
    listed = read_system_packages()
    plan = subprocess.run(["make", "-n", "-C", str(REPO), "system-packages"],
                          capture_output=True, text=True, check=True).stdout
    missing = [package for program, package in listed.items()
               if subprocess.run(["sh", "-c", f"command -v {program}"],
                                 capture_output=True).returncode != 0]
    for package in missing:
        assert package in plan
    if not missing:
        assert "apt-get" not in plan
