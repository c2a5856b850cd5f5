"""The datasets people train SWE agents on, one `DatasetFormat` each: a row's shape, its
image's name and how to get it, and `convert(row)` to a task record, or `DroppedRow` saying
why not. The datasets: docs/sandboxes.md#datasets.
"""

import json
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from undertow.sandboxes import swebench_harness
from undertow.sandboxes.datasets.patches import reverse_patch
from undertow.sandboxes.errors import DroppedRow

_NON_TEST_SUFFIXES = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml",
                      ".yaml", ".toml")
_DIFF_PATH = re.compile(r"^diff --git a/.* b/(.*)$", re.MULTILINE)
_CONDA = ("source /opt/miniconda3/bin/activate", "conda activate testbed")
PYTEST_SUMMARY = "pytest -rA --tb=no -p no:cacheprovider"


@dataclass(frozen=True)
class DatasetFormat:
    """One dataset's row shape and image naming.

    `image_template` is formatted with `image_fields(record)`; `get_image` says how to
    get a missing image (formatted the same way, plus `{image}`).
    """

    name: str
    description: str
    image_template: str
    get_image: str
    convert: Callable[[Mapping[str, Any]], dict[str, Any]]


def image_fields(record: Mapping[str, Any]) -> dict[str, str]:
    """The placeholders an image template may use."""
    instance_id = str(record["instance_id"])
    repo = str(record.get("repo") or "")
    owner, _, name = repo.partition("/")
    commit = str(record.get("base_commit") or "")
    return {"instance_id": instance_id, "instance_id_lower": instance_id.lower(),
            "instance_id_1776": instance_id.lower().replace("__", "_1776_"),
            "instance_id_s": instance_id.lower().replace("__", "_s_"),
            "repo": repo, "repo_owner": owner, "repo_name": name,
            "repo_name_1776": name.lower().replace("__", "_1776_"),
            "base_commit": commit, "base_commit_short": commit[:8],
            "version": str(record.get("version") or "")}


def _require(row: Mapping[str, Any], *names: str) -> None:
    for name in names:
        value = row.get(name)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise DroppedRow(f"no {name}")


def _tests(value: object, field: str) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError:
            raise DroppedRow(f"{field} is not a JSON list") from None
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(t, str) for t in value):
        raise DroppedRow(f"{field} is not a list of test IDs")
    return list(value)


def files_under_test(test_patch: str) -> list[str]:
    """The test files a test_patch touches (as the official harness picks what to run)."""
    return [path for path in _DIFF_PATH.findall(test_patch)
            if not path.endswith(_NON_TEST_SUFFIXES)]


def _swe_bench_record(row: Mapping[str, Any]) -> dict[str, Any]:
    """The SWE-bench fields every SWE-bench-shaped dataset shares."""
    _require(row, "instance_id", "repo", "base_commit", "problem_statement", "test_patch")
    record = {field: row.get(field) or "" for field in (
        "instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch",
        "environment_setup_commit")}
    record["version"] = row.get("version") or ""
    record["FAIL_TO_PASS"] = _tests(row.get("FAIL_TO_PASS"), "FAIL_TO_PASS")
    record["PASS_TO_PASS"] = _tests(row.get("PASS_TO_PASS"), "PASS_TO_PASS")
    if not record["FAIL_TO_PASS"]:
        raise DroppedRow("no FAIL_TO_PASS tests")
    return record


def _with_pytest(record: dict[str, Any]) -> dict[str, Any]:
    """How to test a SWE-bench-shaped row: the official harness's way for a repository and
    version `swebench` knows; else pytest on the test_patch's files, in the image's conda
    environment (the SWE-bench image layout)."""
    repo, version = record["repo"], str(record["version"])
    if swebench_harness.knows(repo, version):
        spec = swebench_harness.official_spec(repo, version, record["test_patch"])
        return {**record, "test_cmd": spec.test_cmd, "log_parser": swebench_harness.SWEBENCH_PARSER,
                "pre_install": list(spec.pre_install), "eval_commands": list(spec.eval_commands)}
    directives = files_under_test(record["test_patch"])
    return {**record, "test_cmd": " ".join([PYTEST_SUMMARY, *directives]),
            "log_parser": "pytest", "eval_commands": list(_CONDA)}


def convert_swe_bench(row: Mapping[str, Any]) -> dict[str, Any]:
    """SWE-bench's rows (and SWE-Gym's, which share their shape, with real lists)."""
    return _with_pytest(_swe_bench_record(row))


def convert_swe_rebench(row: Mapping[str, Any]) -> dict[str, Any]:
    """SWE-rebench: each row carries its own install_config (test_cmd, log_parser name of
    one of swebench's parsers, pre_install, eval_commands) and its docker_image."""
    record = _swe_bench_record(row)
    config = row.get("install_config") or {}
    if isinstance(config, str):
        config = json.loads(config) if config.strip() else {}
    if not config.get("test_cmd"):
        return _with_pytest({**record, "image": row.get("docker_image") or None})
    test_cmd = config["test_cmd"]
    test_cmd = test_cmd[-1] if isinstance(test_cmd, list) else test_cmd
    parser = config.get("log_parser") or "parse_log_pytest"
    record.update({
        "test_cmd": " ".join([test_cmd, *files_under_test(record["test_patch"])]),
        "log_parser": parser if parser.startswith("swebench") else f"swebench:{parser}",
        "pre_install": list(config.get("pre_install") or []),
        "eval_commands": [*_CONDA, *(config.get("eval_commands") or [])],
        "image": row.get("docker_image") or row.get("image_name") or None,
    })
    return record


def swe_smith_start_commands(instance_id: str) -> list[str]:
    """Check out the instance's branch. SWE-smith's images are built before their bugs'
    branches exist, so its harness runs `git fetch` first; here the fetch runs only when
    the image lacks the branch (it then needs `sandbox.network`; without network it fails,
    naming itself)."""
    branch = shlex.quote(instance_id)
    return [f"git show-ref -q {branch} || git fetch -q origin {branch}",
            f"git checkout -q {branch}"]


def convert_swe_smith(row: Mapping[str, Any]) -> dict[str, Any]:
    """SWE-smith: one image per repository (`image_name`), at its main branch; each
    instance's bug is the one commit of a branch named after the instance, which SWE-smith's
    harness checks out in each container before the agent or the tests run: the task's
    `start_commands` (`task_setup.py`). Its `patch` creates the bug (its gold evaluation
    applies it in reverse), so the task's fix is its reverse (`patches.py`). Its tests are
    already in the repository (no test_patch)."""
    _require(row, "instance_id", "repo", "problem_statement")
    instance_id = str(row["instance_id"])
    try:
        fix = reverse_patch(row.get("patch") or "")
    except ValueError:
        raise DroppedRow("its bug patch cannot be reversed (binary or copied files)") from None
    record = {"instance_id": instance_id, "repo": row["repo"],
              "base_commit": row.get("base_commit") or instance_id,
              "problem_statement": row["problem_statement"], "patch": fix,
              "test_patch": "", "version": "",
              "FAIL_TO_PASS": _tests(row.get("FAIL_TO_PASS"), "FAIL_TO_PASS"),
              "PASS_TO_PASS": _tests(row.get("PASS_TO_PASS"), "PASS_TO_PASS"),
              "image": row.get("image_name") or None,
              "start_commands": swe_smith_start_commands(instance_id),
              "test_cmd": PYTEST_SUMMARY, "log_parser": "pytest", "eval_commands": list(_CONDA)}
    if not record["FAIL_TO_PASS"]:
        raise DroppedRow("no FAIL_TO_PASS tests")
    return record


def convert_r2e_gym(row: Mapping[str, Any]) -> dict[str, Any]:
    """R2E-Gym: no instance_id and no FAIL_TO_PASS list; the tests whose expected outcome
    (`expected_output_json`) is a pass must pass, run by the image's `run_tests.sh`."""
    _require(row, "repo_name", "commit_hash", "problem_statement")
    expected = row.get("expected_output_json") or "{}"
    try:
        expected = json.loads(expected) if isinstance(expected, str) else dict(expected)
    except (json.JSONDecodeError, TypeError, ValueError):
        raise DroppedRow("expected_output_json is not a JSON object") from None
    passing = sorted(test for test, status in expected.items() if str(status).upper() == "PASSED")
    if not passing:
        raise DroppedRow("no FAIL_TO_PASS tests")
    commit = str(row["commit_hash"])
    return {"instance_id": f"{row['repo_name']}__{commit[:12]}",
            "repo": str(row.get("repo") or row["repo_name"]), "base_commit": commit,
            "problem_statement": row["problem_statement"], "patch": row.get("patch") or "",
            "test_patch": "", "version": "", "FAIL_TO_PASS": passing, "PASS_TO_PASS": [],
            "image": row.get("docker_image") or None, "test_cmd": "bash run_tests.sh",
            "log_parser": "pytest", "eval_commands": []}


_HUB = "docker pull {image}"
_SWEBENCH_BUILD = ("docker pull {image}, or build it with the official harness: python -m "
                   "swebench.harness.prepare_images --dataset_name {dataset} --instance_ids "
                   "{instance_id}")


def _swe_bench(name: str, hub_name: str, description: str) -> DatasetFormat:
    return DatasetFormat(name, description, "swebench/sweb.eval.x86_64.{instance_id_1776}:latest",
                         _SWEBENCH_BUILD.replace("{dataset}", hub_name), convert_swe_bench)


FORMATS: dict[str, DatasetFormat] = {
    "swe-bench": _swe_bench("swe-bench", "SWE-bench/SWE-bench", "SWE-bench (2,294)"),
    "swe-bench-lite": _swe_bench("swe-bench-lite", "SWE-bench/SWE-bench_Lite",
                                 "SWE-bench Lite (300)"),
    "swe-bench-verified": _swe_bench("swe-bench-verified", "SWE-bench/SWE-bench_Verified",
                                     "SWE-bench Verified (500)"),
    "swe-bench-multilingual": _swe_bench("swe-bench-multilingual",
                                         "SWE-bench/SWE-bench_Multilingual",
                                         "SWE-bench Multilingual (300, 9 languages)"),
    "swe-gym": DatasetFormat("swe-gym", "SWE-Gym (2,438 training instances)",
                             "xingyaoww/sweb.eval.x86_64.{instance_id_s}:latest", _HUB,
                             convert_swe_bench),
    "swe-smith": DatasetFormat("swe-smith", "SWE-smith (synthesized bugs)",
                               "jyangballin/swesmith.x86_64.{repo_name_1776}", _HUB,
                               convert_swe_smith),
    "r2e-gym": DatasetFormat("r2e-gym", "R2E-Gym", "namanjain12/{repo}_final:{base_commit}",
                             _HUB, convert_r2e_gym),
    "swe-rebench": DatasetFormat("swe-rebench", "SWE-rebench",
                                 "swerebench/sweb.eval.x86_64.{instance_id_1776}:latest", _HUB,
                                 convert_swe_rebench),
}


def get_format(name: str) -> DatasetFormat:
    try:
        return FORMATS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(FORMATS)}") from None
