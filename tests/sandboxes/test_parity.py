"""Parity with the official SWE-bench harness: Undertow's verdict on a test log, per test
and per instance, equals the `swebench` grader's on the same log. Any disagreement fails.

The logs: the bundled tasks' empty and gold runs (each task's tests run here, on the host,
from its prepared testbed, with Undertow's test script), and logs written below in the
formats of pytest, Django's runner, sympy's, and the other runners `swebench` parses. For
a repository `swebench` knows, the task loads with `log_parser = "swebench"` (the official
parser); for the bundled ones, Undertow's own parser is checked against `swebench`'s
`parse_log_pytest`.
"""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from undertow.sandboxes.grading import GradingConfig, grading_script, judge
from undertow.sandboxes.swebench_harness import END_MARKER, START_MARKER, official_report
from undertow.sandboxes.task import Task, load_tasks, parse_task
from undertow.sandboxes.task_image import prepare_testbed
from undertow.sandboxes.taskset import BUNDLED_DIR

FULL, PARTIAL, NO = "RESOLVED_FULL", "RESOLVED_PARTIAL", "RESOLVED_NO"
ALWAYS = GradingConfig(partial_credit="always")


def undertow_report(task: Task, log: str) -> dict:
    """Undertow's verdict in the harness's report shape."""
    verdict = judge(task, log, ALWAYS)
    if not verdict.found:
        return {"status": NO, "tests": None, "found": False}
    status = FULL if verdict.resolved else PARTIAL if 0 < verdict.reward < 1 else NO
    tests = {kind: {"success": [t for t in listed if t in verdict.successes],
                    "failure": [t for t in listed if t in verdict.failures]}
             for kind, listed in (("FAIL_TO_PASS", task.FAIL_TO_PASS),
                                  ("PASS_TO_PASS", task.PASS_TO_PASS))}
    return {"status": status, "tests": tests, "found": True}


def swebench_report(task: Task, log: str) -> dict:
    log_parser = task.log_parser if task.log_parser.startswith("swebench") else (
        "swebench:parse_log_pytest")
    report = official_report(log, instance_id=task.instance_id, repo=task.repo,
                             version=task.version, log_parser=log_parser,
                             fail_to_pass=task.FAIL_TO_PASS, pass_to_pass=task.PASS_TO_PASS)
    if report["tests"] is not None:
        report["tests"] = {kind: report["tests"][kind] for kind in ("FAIL_TO_PASS",
                                                                     "PASS_TO_PASS")}
    return report


def assert_parity(task: Task, log: str) -> dict:
    ours, theirs = undertow_report(task, log), swebench_report(task, log)
    assert ours == theirs, f"{task.instance_id}: Undertow {ours} != swebench {theirs}"
    return ours


def _task(repo: str, version: str, f2p: list[str], p2p: list[str], **fields) -> Task:
    record = {"instance_id": f"{repo.replace('/', '__')}-{version}", "repo": repo,
              "version": version, "base_commit": "0" * 40, "problem_statement": "",
              "patch": "", "test_patch": "diff --git a/tests/test_x.py b/tests/test_x.py\n",
              "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "image": "example/image", **fields}
    return parse_task(record, "parity case")


def _bracket(body: str) -> str:
    return f"+ git apply test.patch\n{START_MARKER}\n{body}\n{END_MARKER}\n+ git checkout\n"


# --- Undertow's own pytest parser against swebench's parse_log_pytest ---

PYTEST_LOG = _bracket("""\
============================= test session starts ==============================
tests/test_a.py .F.sExX                                                   [100%]
=========================== short test summary info ============================
PASSED tests/test_a.py::test_one
PASSED tests/test_a.py::test_param[a b]
PASSED tests/test_a.py::test_teardown
SKIPPED [1] tests/test_a.py:9: not today
SKIPPED tests/test_a.py::test_skipped
FAILED tests/test_a.py::test_two - AssertionError: assert 1 == 2
ERROR tests/test_a.py::test_teardown - RuntimeError: boom
XFAIL tests/test_a.py::test_known - flaky upstream
XPASS tests/test_a.py::test_lucky
\x1b[32mPASSED\x1b[0m tests/test_a.py::test_colored
========= 1 failed, 3 passed, 1 skipped, 1 xfailed, 1 xpassed, 1 error =========""")

UNDERTOW_CASES = {
    "all pass": (["tests/test_a.py::test_one", "tests/test_a.py::test_known"],
                 ["tests/test_a.py::test_param[a"], PYTEST_LOG),
    "partial": (["tests/test_a.py::test_one", "tests/test_a.py::test_two"],
                ["tests/test_a.py::test_param[a"], PYTEST_LOG),
    "error after a pass": (["tests/test_a.py::test_one"], ["tests/test_a.py::test_teardown"],
                           PYTEST_LOG),
    "space in the ID": (["tests/test_a.py::test_param[a b]"], [], PYTEST_LOG),
    "xpass and colour are not passes": (
        ["tests/test_a.py::test_lucky", "tests/test_a.py::test_one"],
        ["tests/test_a.py::test_colored"], PYTEST_LOG),
    "skipped counts neither way": (["tests/test_a.py::test_skipped"],
                                   ["tests/test_a.py::test_one"], PYTEST_LOG),
    "missing test": (["tests/test_a.py::test_absent"], [], PYTEST_LOG),
    "no FAIL_TO_PASS": ([], ["tests/test_a.py::test_one"], PYTEST_LOG),
    "no markers": (["tests/test_a.py::test_one"], [], "PASSED tests/test_a.py::test_one\n"),
    "timed out": (["tests/test_a.py::test_one"], [],
                  PYTEST_LOG + ">>>>> Tests Timed Out\n"),
    "patch did not apply": (["tests/test_a.py::test_one"], [],
                            ">>>>> Patch Apply Failed\n" + PYTEST_LOG),
    "tests errored": (["tests/test_a.py::test_one"], [], PYTEST_LOG + ">>>>> Tests Errored\n"),
    "results outside the markers": (["t.py::test_x"], [],
                                    _bracket("collected 1 item") + "PASSED t.py::test_x\n"),
}


@pytest.mark.parametrize("name", sorted(UNDERTOW_CASES))
def test_undertow_pytest_parser_agrees(name):
    f2p, p2p, log = UNDERTOW_CASES[name]
    task = _task("undertow-bundled/example", "", f2p, p2p)
    assert task.log_parser == "pytest"
    assert_parity(task, log)


def test_the_cases_cover_every_verdict():
    statuses = {assert_parity(_task("undertow-bundled/example", "", *case[:2]), case[2])[
        "status"] for case in UNDERTOW_CASES.values()}
    assert statuses == {FULL, PARTIAL, NO}


# --- Repositories swebench knows: their own parsers, in their runners' formats ---

DJANGO_LOG = _bracket("""\
Testing against Django installed in '/testbed/django'
Importing application utils_tests
test_add (utils_tests.test_math.MathTests) ... ok
test_sub (utils_tests.test_math.MathTests) ... FAIL
test_mul (utils_tests.test_math.MathTests) ... ERROR
test_db (utils_tests.test_math.MathTests) ... skipped 'no database'
test_slow (utils_tests.test_math.MathTests) ... Testing against Django installed in \
'/testbed/django' silenced).
ok
test_print (utils_tests.test_math.MathTests) ... System check identified no issues (0 silenced).
ok

======================================================================
FAIL: test_sub (utils_tests.test_math.MathTests)
----------------------------------------------------------------------
AssertionError: 1 != 2

Ran 6 tests in 0.012s
FAILED (failures=1, errors=1, skipped=1)""")

SYMPY_LOG = _bracket("""\
============================= test process starts ==============================
executable:         /opt/miniconda3/envs/testbed/bin/python  (3.9.19-final-0) [CPython]
sympy/core/tests/test_basic.py[4]
test_structure ok
test_equality F
test_matches_basic E
test_has ok

________________________________________________________________________________
___________ sympy/core/tests/test_basic.py:test_equality ____________
AssertionError
============= tests finished: 2 passed, 1 failed, 1 exceptions ==============""")

MATPLOTLIB_LOG = _bracket("""\
PASSED lib/matplotlib/tests/test_widgets.py::test_span[MouseButton.LEFT]
FAILED lib/matplotlib/tests/test_widgets.py::test_span[MouseButton.RIGHT] - assert 0
PASSED lib/matplotlib/tests/test_axes.py::test_plot""")

ASTROPY_LOG = _bracket("""\
\x1b[1m============================= test session starts ==============================\x1b[0m
astropy/io/tests/test_a.py::test_read PASSED
astropy/io/tests/test_a.py::test_write FAILED
PASSED astropy/io/tests/test_a.py::test_roundtrip
FAILED astropy/io/tests/test_a.py::test_write - ValueError""")

REQUESTS_LOG = _bracket("""\
PASSED tests/test_requests.py::test_get[http://example.org/path/to/thing]
FAILED tests/test_requests.py::test_post[/tmp/a/b/c] - boom
PASSED tests/test_requests.py::test_head""")

SEABORN_LOG = _bracket("""\
tests/test_core.py::test_palette PASSED                                  [ 33%]
FAILED tests/test_core.py::test_hue - AssertionError
PASSED tests/test_core.py::test_size""")

GO_LOG = _bracket("""\
=== RUN   TestReplacerNew
--- PASS: TestReplacerNew (0.00s)
=== RUN   TestReplacerSet
--- FAIL: TestReplacerSet (0.01s)
--- SKIP: TestReplacerWindows (0.00s)
FAIL""")

CARGO_LOG = _bracket("""\
running 3 tests
test regression::r1 ... ok
test regression::r2 ... FAILED
test regression::r3 ... ignored
test result: FAILED. 1 passed; 1 failed; 1 ignored""")

MAVEN_LOG = _bracket("""\
+ mvnd test -B -T 1C -pl gson -Dtest=com.google.gson.functional.PrimitiveTest#testA
[INFO] BUILD SUCCESS
+ mvnd test -B -T 1C -pl gson -Dtest=com.google.gson.functional.PrimitiveTest#testB
[INFO] BUILD FAILURE""")

MARKED_LOG = _bracket("""\
Started
...F.
Failures:
1) Marked Code spans should handle backticks
  Message: Expected false to be truthy.
5 specs, 1 failure""")

KNOWN = {
    "django": ("django/django", "3.0", DJANGO_LOG, "utils_tests.test_math.MathTests", [
        ["test_add ({m})", "test_slow ({m})", "test_print ({m})"], ["test_db ({m})"],
        ["test_sub ({m})"], ["test_mul ({m})"]]),
    "sympy": ("sympy/sympy", "1.1", SYMPY_LOG, "", [
        ["test_structure", "test_has"], [], ["test_equality", "test_matches_basic"],
        ["test_absent", "sympy/core/tests/test_basic.py:test_equality"]]),
    "pytest": ("pytest-dev/pytest", "5.4", PYTEST_LOG, "", [
        ["tests/test_a.py::test_one", "tests/test_a.py::test_known"],
        ["tests/test_a.py::test_skipped"], ["tests/test_a.py::test_two"],
        ["tests/test_a.py::test_lucky"]]),
    "matplotlib": ("matplotlib/matplotlib", "3.5", MATPLOTLIB_LOG, "", [
        ["lib/matplotlib/tests/test_widgets.py::test_span[1]",
         "lib/matplotlib/tests/test_axes.py::test_plot"], [],
        ["lib/matplotlib/tests/test_widgets.py::test_span[3]"], []]),
    "astropy": ("astropy/astropy", "4.3", ASTROPY_LOG, "", [
        ["astropy/io/tests/test_a.py::test_read", "astropy/io/tests/test_a.py::test_roundtrip"],
        [], ["astropy/io/tests/test_a.py::test_write"], []]),
    "requests": ("psf/requests", "2.0", REQUESTS_LOG, "", [
        ["tests/test_requests.py::test_get[http://example.org/path/to/thing]",
         "tests/test_requests.py::test_head"], [],
        ["tests/test_requests.py::test_post[/c]"], []]),
    "seaborn": ("mwaskom/seaborn", "0.12", SEABORN_LOG, "", [
        ["tests/test_core.py::test_palette", "tests/test_core.py::test_size"], [],
        ["tests/test_core.py::test_hue"], []]),
    "go": ("caddyserver/caddy", "6411", GO_LOG, "", [
        ["TestReplacerNew"], ["TestReplacerWindows"], ["TestReplacerSet"], []]),
    "cargo": ("burntsushi/ripgrep", "2576", CARGO_LOG, "", [
        ["regression::r1"], [], ["regression::r2"], ["regression::r3"]]),
    "maven": ("google/gson", "2311", MAVEN_LOG, "", [
        ["com.google.gson.functional.PrimitiveTest#testA"], [],
        ["com.google.gson.functional.PrimitiveTest#testB"], []]),
    "marked (graded by failures only)": ("markedjs/marked", "4.0", MARKED_LOG, "", [
        ["Marked Code spans should handle the rest"], ["Marked never reported"],
        ["Marked Code spans should handle backticks"], []]),
}


def _known_cases():
    """Per runner: passing, skipped, failing and missing tests, in FAIL_TO_PASS/PASS_TO_PASS
    splits that give each verdict, and the same tests on a log without markers."""
    for name, (repo, version, log, module, groups) in KNOWN.items():
        passing, skipped, failing, other = ([t.format(m=module) for t in group]
                                            for group in groups)
        splits = {
            "resolved": (passing[:1], passing[1:] + skipped, FULL),
            "partial": (passing[:1] + failing, passing[1:], PARTIAL),
            "broken PASS_TO_PASS": (passing[:1], failing + other, NO),
            "failing and missing": (failing + other, [], NO),
        }
        for split, (f2p, p2p, status) in splits.items():
            yield pytest.param(repo, version, f2p, p2p, log, status, id=f"{name}-{split}")
        yield pytest.param(repo, version, passing, [], log.replace(END_MARKER, "end"), NO,
                           id=f"{name}-no end marker")


@pytest.mark.parametrize(("repo", "version", "f2p", "p2p", "log", "status"),
                         list(_known_cases()))
def test_known_repository_verdicts_agree(repo, version, f2p, p2p, log, status):
    task = _task(repo, version, f2p, p2p)
    assert task.log_parser == "swebench" and task.test_cmd != "python3 -m pytest"
    assert judge(task, log).decided_by == "swebench"
    assert assert_parity(task, log)["status"] == status


def test_known_repositories_take_the_official_commands():
    task = _task("django/django", "3.0", [], [], test_patch=(
        "diff --git a/tests/utils_tests/test_math.py b/tests/utils_tests/test_math.py\n"))
    assert task.test_cmd.startswith("./tests/runtests.py --verbosity 2")
    assert task.test_cmd.endswith(" utils_tests.test_math")
    assert "conda activate testbed" in task.eval_commands
    assert any("locale" in command or "LANG" in command for command in task.eval_commands)
    sympy = _task("sympy/sympy", "1.1", [], [])
    assert "bin/test" in sympy.test_cmd
    named = _task("django/django", "3.0", [], [], log_parser="pytest")
    assert named.log_parser == "pytest" and named.eval_commands == ()


# --- The bundled tasks' empty and gold runs ---

def _run_tests(task: Task, testbed: Path, patch: str) -> str:
    for diff in (patch, task.test_patch):
        if diff.strip():
            subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=testbed,
                           input=diff, text=True, check=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run(["bash", "-c", grading_script(task)], cwd=testbed, env=env,
                            capture_output=True, text=True, timeout=300)
    return result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("task", load_tasks(BUNDLED_DIR), ids=lambda task: task.instance_id)
def test_bundled_empty_and_gold_runs_agree(task, tmp_path):
    verdicts = []
    for name, patch in (("empty", ""), ("gold", task.patch)):
        testbed = tmp_path / name
        prepare_testbed(replace(task), testbed)
        verdicts.append(assert_parity(task, _run_tests(task, testbed, patch))["status"])
    assert verdicts == [NO, FULL]
