"""The official SWE-bench harness (the optional `swebench` package, 4.x) where it already does
the job: specs, log parsers and grader of the repositories it knows, imported only when one of
these functions runs (docs/sandboxes.md#grading).
"""

import functools
import importlib
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

from undertow.sandboxes.errors import SwebenchMissing
from undertow.sandboxes.log_parsers import ERROR, FAILED, PASSED, SKIPPED, XFAILED

START_MARKER = ">>>>> Start Test Output"
END_MARKER = ">>>>> End Test Output"
TIMEOUT_MARKER = ">>>>> Tests Timed Out"
APPLY_FAILED_MARKER = ">>>>> Patch Apply Failed"
# A log holding any of these gives no verdict (the harness's `get_logs_eval`).
NO_VERDICT_MARKERS = (APPLY_FAILED_MARKER, ">>>>> Reset Failed", ">>>>> Tests Errored",
                      TIMEOUT_MARKER)
SWEBENCH_PARSER = "swebench"
_CONDA_ACTIVATE = ("source /opt/miniconda3/bin/activate", "conda activate testbed")
_STATUS = {"PASSED": PASSED, "FAILED": FAILED, "ERROR": ERROR, "SKIPPED": SKIPPED,
           "XFAIL": XFAILED}
_PARSER_MODULES = ("python", "javascript", "c", "go", "java", "php", "ruby", "rust")


@dataclass(frozen=True)
class OfficialSpec:
    """What the official harness runs for one repository and version.

    `test_cmd` includes the test directives taken from the task's `test_patch`, as
    the harness's eval script does; `eval_commands` run before it in the same shell
    (environment activation, the specification's `eval_commands` and `install`);
    `pre_install` are the image set-up commands of the specification.
    """

    repo: str
    version: str
    test_cmd: str
    eval_commands: tuple[str, ...]
    pre_install: tuple[str, ...]
    log_parser: str


def _import(name: str) -> ModuleType:
    """Imports a `swebench` module; its optional imports' deprecation warnings are not ours."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except ImportError as error:
        raise SwebenchMissing(
            f"this task is graded by the official SWE-bench harness, and the swebench package "
            f"is not installed ({error}); pip install 'undertow[swebench]'") from None


@functools.cache
def is_installed() -> bool:
    try:
        _import("swebench.harness.constants")
    except SwebenchMissing:
        return False
    return True


def _specs() -> dict:
    return _import("swebench.harness.constants").MAP_REPO_VERSION_TO_SPECS


def knows(repo: str, version: str) -> bool:
    """Whether `swebench` has a specification for this repository at this version."""
    return bool(version) and is_installed() and version in _specs().get(repo, {})


def _instance(repo: str, version: str, test_patch: str) -> dict:
    return {"instance_id": "undertow", "repo": repo, "version": version,
            "test_patch": test_patch, "base_commit": "HEAD"}


def official_spec(repo: str, version: str, test_patch: str) -> OfficialSpec:
    """The official test command and set-up of a repository it knows (see `knows`)."""
    specs = _specs()[repo][version]
    constants = _import("swebench.harness.constants")
    instance = _instance(repo, version, test_patch)
    if constants.MAP_REPO_TO_EXT[repo] == "py":
        directives = _import("swebench.harness.test_spec.python").get_test_directives(instance)
        test_cmd = " ".join([specs["test_cmd"], *directives])
        before = [*_CONDA_ACTIVATE, *specs.get("eval_commands", [])]
        before += [specs["install"]] if "install" in specs else []
    else:
        commands = _import("swebench.harness.test_spec.utils").get_test_cmds(instance)
        test_cmd = "\n".join(commands)
        before = [*specs.get("eval_commands", []), *specs.get("build", [])]
    parser = _import("swebench.harness.log_parsers").MAP_REPO_TO_PARSER[repo]
    return OfficialSpec(repo, version, test_cmd, tuple(before),
                        tuple(specs.get("pre_install", [])), f"swebench:{parser.__name__}")


def _named_parser(name: str) -> Callable:
    for module in _PARSER_MODULES:
        parser = getattr(_import(f"swebench.harness.log_parsers.{module}"), name, None)
        if callable(parser):
            return parser
    raise ValueError(f"swebench has no log parser {name!r}")


def _test_spec(instance_id: str, repo: str, version: str, fail_to_pass: Sequence[str],
               pass_to_pass: Sequence[str]):
    """A `swebench` TestSpec with what its parsers and grader read (no scripts needed)."""
    constants = _import("swebench.harness.constants")
    test_spec = _import("swebench.harness.test_spec.test_spec")
    return test_spec.TestSpec(
        instance_id=instance_id, repo=repo, version=version, repo_script_list=[],
        eval_script_list=[], env_script_list=[], arch="x86_64",
        FAIL_TO_PASS=list(fail_to_pass), PASS_TO_PASS=list(pass_to_pass),
        language=constants.MAP_REPO_TO_EXT.get(repo, "py"), docker_specs={}, namespace=None)


def _log_file(log: str) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False, encoding="utf-8") as file:
        file.write(log)
    return file.name


def official_status_map(log: str, *, instance_id: str, repo: str, version: str,
                        log_parser: str, fail_to_pass: Sequence[str] = (),
                        pass_to_pass: Sequence[str] = ()) -> tuple[dict[str, str], bool]:
    """The harness's raw status map of a log and whether it found test output at all.

    `log_parser` is `swebench` (the repository's parser: `get_logs_eval` itself reads
    the log) or `swebench:<function>` (that parser on the log between the markers,
    with `get_logs_eval`'s rules).
    """
    spec = _test_spec(instance_id, repo, version, fail_to_pass, pass_to_pass)
    if log_parser == SWEBENCH_PARSER:
        path = _log_file(log)
        try:
            return _import("swebench.harness.grading").get_logs_eval(spec, path)
        finally:
            os.unlink(path)
    parser = _named_parser(log_parser.partition(":")[2])
    if not holds_verdict(log):
        return {}, False
    status_map = parser(log.split(START_MARKER)[1].split(END_MARKER)[0], spec)
    return (status_map or parser(log, spec)), True


def holds_verdict(log: str) -> bool:
    """Whether a log can give a verdict: both markers, and none of `NO_VERDICT_MARKERS`."""
    return (START_MARKER in log and END_MARKER in log
            and not any(marker in log for marker in NO_VERDICT_MARKERS))


def is_fail_only(repo: str, log_parser: str) -> bool:
    """Whether the harness grades this repository by its failures only (a test not in the
    log counts as passing): the repositories whose parsers see failures only."""
    if log_parser != SWEBENCH_PARSER:
        return False
    return repo in _import("swebench.harness.constants").FAIL_ONLY_REPOS


def official_statuses(log: str, *, instance_id: str, repo: str, version: str,
                      log_parser: str, fail_to_pass: Sequence[str] = (),
                      pass_to_pass: Sequence[str] = ()) -> tuple[dict[str, str], bool]:
    """`official_status_map` in Undertow's statuses (other words of a parser are kept lower-
    cased, and count neither as a pass nor as a failure, as in the harness)."""
    status_map, found = official_status_map(
        log, instance_id=instance_id, repo=repo, version=version, log_parser=log_parser,
        fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass)
    return {test: _STATUS.get(status, str(status).lower())
            for test, status in status_map.items()}, found


def official_report(log: str, *, instance_id: str, repo: str, version: str, log_parser: str,
                    fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]) -> dict:
    """The harness's own verdict on a log: `{"status": RESOLVED_FULL|PARTIAL|NO, "tests":
    {FAIL_TO_PASS: {success, failure}, PASS_TO_PASS: {...}} or None, "found": bool}`.

    For `swebench` (a repository it knows) this is `get_eval_report` itself, the function
    its `run_evaluation` calls on each instance's log; for `swebench:<function>`, that
    parser with the same report and resolution rules.
    """
    grading = _import("swebench.harness.grading")
    fields = {"instance_id": instance_id, "repo": repo, "version": version,
              "fail_to_pass": fail_to_pass, "pass_to_pass": pass_to_pass}
    if log_parser == SWEBENCH_PARSER:
        path = _log_file(log)
        try:
            prediction = {"instance_id": instance_id, "model_patch": "",
                          "model_name_or_path": "undertow"}
            spec = _test_spec(**fields)
            report = grading.get_eval_report(spec, prediction, path, True)[instance_id]
        finally:
            os.unlink(path)
        tests = report.get("tests_status")
    else:
        status_map, found = official_status_map(log, log_parser=log_parser, **fields)
        gold = {"FAIL_TO_PASS": list(fail_to_pass), "PASS_TO_PASS": list(pass_to_pass)}
        tests = grading.get_eval_tests_report(status_map, gold) if found else None
    if tests is None:
        return {"status": "RESOLVED_NO", "tests": None, "found": False}
    return {"status": grading.get_resolution_status(tests), "tests": tests, "found": True}
