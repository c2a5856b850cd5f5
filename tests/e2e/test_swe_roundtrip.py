"""The SWE ecosystem round trip: dataset rows in, official verdicts out.

1. `undertow tasks import` of fixture rows of every dataset (the counts each must keep);
2. rows of two bundled tasks in SWE-rebench's shape (its per-row install_config names
   swebench's `parse_log_pytest`), and one SWE-bench row that dresses the first bundled
   task as `pytest-dev/pytest` 5.4, a repository `swebench` knows (so that its official
   test command, eval commands and `get_eval_report` itself run here); imported, their
   images built here from the bundled sources and tagged with the names the import gave;
   and a SWE-bench row of the second task under a repository it does not know (Undertow's
   own pytest parser decides; `undertow tasks validate` says which side decided each);
   and the first task as a SWE-smith row: its repository (fixed source and held-back
   tests) at `main` in an image built here, its bug the one commit of the instance's
   branch, which the sandbox checks out when it starts (the row's `patch` makes the bug);
3. `undertow rollout` of that set with a command scaffold that applies the gold patch to
   the first task, its disguises and the SWE-bench row of the second, and nothing to the
   second;
4. `undertow export predictions`;
5. the `swebench` grader's report on each session's own test log equals the reward
   Undertow gave that session, per instance and per test.
"""

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import docker
import pytest

from tests.sandboxes import dataset_rows
from tests.sandboxes.swe_smith_images import (
    add_instance_branch,
    build_repository_image,
    init_main,
)
from undertow.cli import main
from undertow.sandboxes.base_image import build_base_image
from undertow.sandboxes.connection import connect
from undertow.sandboxes.datasets.formats import files_under_test
from undertow.sandboxes.grading import diff_key
from undertow.sandboxes.swebench_harness import official_report
from undertow.sandboxes.task import load_tasks
from undertow.sandboxes.task_image import ensure_task_image
from undertow.sandboxes.taskset import BUNDLED_DIR

GOLD, EMPTY = "calclang__calclang-2", "inilike__inilike-17"
KNOWN = "pytest-dev__pytest-90002"  # GOLD, as a row of a repository swebench knows
OURS = "acme__inilike-17"  # EMPTY, as a SWE-bench row of a repository it does not know
SMITH = "undertow__calclang.8ea95c91.func_pm_power__2"  # GOLD, as a SWE-smith row
SOURCES = {GOLD: GOLD, EMPTY: EMPTY, KNOWN: GOLD, OURS: EMPTY}
KEPT = {"swe-bench": 3, "swe-bench-lite": 3, "swe-bench-verified": 3,
        "swe-bench-multilingual": 2, "swe-gym": 2, "swe-smith": 2, "r2e-gym": 2,
        "swe-rebench": 2}


def _p2p_in_test_files(task) -> list[str]:
    """The official command runs only the test_patch's files; PASS_TO_PASS keeps their tests."""
    files = files_under_test(task.test_patch)
    return [t for t in task.PASS_TO_PASS if t.split("::")[0] in files]


def _rebench_row(task) -> dict:
    """A bundled task as SWE-rebench stores a row."""
    return {"instance_id": task.instance_id, "repo": task.repo, "base_commit": task.base_commit,
            "patch": task.patch, "test_patch": task.test_patch,
            "problem_statement": task.problem_statement, "version": "0.1",
            "FAIL_TO_PASS": json.dumps(list(task.FAIL_TO_PASS)),
            "PASS_TO_PASS": json.dumps(_p2p_in_test_files(task)),
            "install_config": {"test_cmd": "python -m pytest -rA -p no:cacheprovider",
                               "log_parser": "parse_log_pytest"}}


def _swe_bench_row(instance_id, repo, version, task) -> dict:
    """A bundled task as a SWE-bench row (pytest-dev/pytest 5.4: the official test command
    `pytest -rA <test files>`; its conda and pip lines fail harmlessly in the base image)."""
    return dataset_rows.swe_bench_row(
        instance_id, repo, version, task.FAIL_TO_PASS, _p2p_in_test_files(task),
        base_commit=task.base_commit, patch=task.patch, test_patch=task.test_patch)


def _swe_smith_row(task, tmp_path: Path) -> tuple[dict, Path]:
    """`task` as SWE-smith ships it: the repository (its fixed source with the held-back
    tests) at `main`, the bug on the branch SMITH; and the row, whose patch makes the bug."""
    repo = tmp_path / "smith-testbed"
    shutil.copytree(task.source_dir, repo,
                    ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc"))
    git_apply = ["git", "apply", "--whitespace=nowarn"]
    subprocess.run(git_apply, cwd=repo, input=task.test_patch, text=True, check=True)
    init_main(repo)
    bug_patch = add_instance_branch(repo, SMITH, lambda repo: subprocess.run(
        [*git_apply, "-R"], cwd=repo, input=task.patch, text=True, check=True))
    row = {"instance_id": SMITH, "repo": "swesmith/undertow__calclang.8ea95c91",
           "patch": bug_patch, "problem_statement": task.problem_statement,
           "FAIL_TO_PASS": list(task.FAIL_TO_PASS), "PASS_TO_PASS": list(task.PASS_TO_PASS),
           "image_name": "jyangballin/swesmith.x86_64.undertow_1776_calclang.8ea95c91"}
    return row, repo


def _build_images(imported, smith_repo: Path) -> None:
    """Each task's image, built from its bundled source, under the imported image name; the
    SWE-smith row's from its repository."""
    bundled = {task.instance_id: task for task in load_tasks(BUNDLED_DIR)}
    client = docker.from_env()
    others = [task for task in imported if task.instance_id != SMITH]

    async def build():
        with connect(os.environ.get("DOCKER_HOST")) as connection:
            base = (await build_base_image(connection)).tag
            return base, [await ensure_task_image(connection,
                                                  bundled[SOURCES[task.instance_id]])
                          for task in others]

    try:
        base, tags = asyncio.run(build())
        for task, tag in zip(others, tags, strict=True):
            repository, _, name = task.image.rpartition(":")
            client.images.get(tag).tag(repository, name)
        [smith] = [task for task in imported if task.instance_id == SMITH]
        build_repository_image(client, base, smith_repo, smith.image)
    finally:
        client.close()


def _import_everything(tmp_path: Path) -> None:
    tmp_path.mkdir()
    for name, rows in dataset_rows.ROWS.items():
        source = tmp_path / f"{name}.jsonl"
        source.write_text("".join(json.dumps(row) + "\n" for row in rows))
        assert main(["tasks", "import", name, "--from", str(source), "--out",
                     str(tmp_path / name)]) == 0
        assert len(load_tasks(tmp_path / name)) == KEPT[name], name


@pytest.fixture(scope="module")
def imported_set(tmp_path_factory):
    """The SWE-rebench-shaped set of two bundled tasks, imported, its images built here, and
    the command scaffold's command line that applies the gold patch to GOLD only."""
    tmp_path = tmp_path_factory.mktemp("roundtrip")
    bundled = {task.instance_id: task for task in load_tasks(BUNDLED_DIR)}
    sets = []
    smith_row, smith_repo = _swe_smith_row(bundled[GOLD], tmp_path)
    for name, rows in (("swe-rebench", [_rebench_row(bundled[GOLD]),
                                        _rebench_row(bundled[EMPTY])]),
                       ("swe-bench", [
                           _swe_bench_row(KNOWN, "pytest-dev/pytest", "5.4", bundled[GOLD]),
                           _swe_bench_row(OURS, "acme/inilike", "0.1", bundled[EMPTY])]),
                       ("swe-smith", [smith_row])):
        source = tmp_path / f"{name}.jsonl"
        source.write_text("".join(json.dumps(row) + "\n" for row in rows))
        assert main(["tasks", "import", name, "--from", str(source), "--out",
                     str(tmp_path / name)]) == 0
        sets.append((tmp_path / name / "tasks.jsonl").read_text())
    task_set = tmp_path / "set"
    task_set.mkdir()
    (task_set / "tasks.jsonl").write_text("".join(sets))
    imported = load_tasks(task_set)
    assert [t.log_parser for t in imported] == ["swebench:parse_log_pytest"] * 2 + [
        "swebench", "pytest", "pytest"]
    assert imported[2].test_cmd == "pytest -rA tests/test_issue_2.py"
    _build_images(imported, smith_repo)
    patches = tmp_path / "patches"
    patches.mkdir()
    for instance_id in (GOLD, KNOWN, OURS):
        (patches / f"{instance_id}.diff").write_text(bundled[SOURCES[instance_id]].patch)
    (patches / f"{SMITH}.diff").write_text(imported[4].patch)  # the reverse of its bug patch
    command = (f"if [ -f {patches}/{{instance_id}}.diff ]; then "
               f"docker exec -i -u 1000 {{container}} "
               f"git -C {{repo_dir}} apply - < {patches}/{{instance_id}}.diff; fi")
    return task_set, imported, command


@pytest.mark.docker
@pytest.mark.slow
def test_import_rollout_export_and_the_official_verdict(imported_set, tiny_model_dir, tmp_path,
                                                        capsys):
    _import_everything(tmp_path / "datasets")
    task_set, imported, command = imported_set
    out = tmp_path / "runs"
    capsys.readouterr()
    assert main(["rollout", "--tasks", str(task_set), "--scaffold", "command", "--model",
                 str(tiny_model_dir), "--out", str(out), "timeout_s=300",
                 "progress_interval_s=0", f"scaffold_options.command={json.dumps(command)}"]
                ) == 0
    [run] = [path.parent for path in out.glob("*/summary.json")]
    sessions = {s["instance_id"]: s for s in json.loads((run / "summary.json").read_text())[
        "sessions"]}
    assert {i: s["reward"] for i, s in sessions.items()} == {GOLD: 1.0, EMPTY: 0.0,
                                                              KNOWN: 1.0, OURS: 1.0,
                                                              SMITH: 1.0}
    smith_log = (run / "sessions" / sessions[SMITH]["session_id"] / "sandbox.log").read_text()
    assert f"$ git checkout -q {SMITH}\n# exit code 0" in smith_log

    preds = tmp_path / "preds.jsonl"
    assert main(["export", "predictions", str(run), "--out", str(preds)]) == 0
    predictions = {p["instance_id"]: p for p in map(json.loads, preds.read_text().splitlines())}
    assert predictions[GOLD]["model_patch"].startswith("diff --git")
    assert predictions[EMPTY]["model_patch"] == ""

    for task in imported:
        session = sessions[task.instance_id]
        log = run / "test-logs" / task.instance_id / f"{diff_key(session['details']['diff'])}.log"
        report = official_report(
            log.read_text(), instance_id=task.instance_id, repo=task.repo, version=task.version,
            log_parser=task.log_parser if task.log_parser != "pytest" else (
                "swebench:parse_log_pytest"), fail_to_pass=task.FAIL_TO_PASS,
            pass_to_pass=task.PASS_TO_PASS)
        assert report["found"]
        resolved = report["status"] == "RESOLVED_FULL"
        assert (resolved, float(resolved)) == (session["resolved"], session["reward"])
        for kind in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            passed = {t for t, status in session["tests"].items() if status == "passed"}
            assert set(report["tests"][kind]["success"]) == passed & set(getattr(task, kind))


@pytest.mark.docker
@pytest.mark.slow
def test_eval_runs_the_scaffold_and_scores_pass_at_k(imported_set, tiny_model_dir, tmp_path,
                                                     capsys):
    task_set, _, command = imported_set
    capsys.readouterr()
    assert main(["eval", "--tasks", str(task_set), "--scaffold", "command", "-o",
                 f"command={command}", "--model", str(tiny_model_dir), "-k", "2",
                 "--concurrency", "2", "--out", str(tmp_path / "eval")]) == 0
    out = capsys.readouterr().out
    assert f"| {GOLD} | 2 | 2 | 1.000 |" in out and f"| {EMPTY} | 2 | 0 | 0.000 |" in out
    assert f"| {KNOWN} | 2 | 2 | 1.000 |" in out and f"| {OURS} | 2 | 2 | 1.000 |" in out
    assert f"| {SMITH} | 2 | 2 | 1.000 |" in out
    assert "| **all (5 tasks)** | | | 0.800 |" in out
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["results"][0]["pass_at_k"] == pytest.approx(4 / 5)


@pytest.mark.docker
@pytest.mark.slow
def test_validate_says_which_side_decided(imported_set, capsys):
    task_set, _, _ = imported_set
    assert main(["tasks", "validate", str(task_set), "--runs", "1"]) == 0
    out = capsys.readouterr().out
    for instance_id, side in ((GOLD, "swebench"), (EMPTY, "swebench"), (KNOWN, "swebench"),
                              (OURS, "undertow"), (SMITH, "undertow")):
        assert f"| {instance_id} | ok | {side} | 1 |" in out, out
    assert "5/5 tasks valid; verdicts decided by swebench for 3, by undertow for 2" in out
