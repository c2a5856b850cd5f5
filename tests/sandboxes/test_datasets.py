"""Dataset loaders and `undertow tasks import`, on fixture rows of each dataset's shape."""

import asyncio
import json
import subprocess

import pytest

from tests.sandboxes import dataset_rows
from undertow.cli import main
from undertow.sandboxes.datasets.formats import FORMATS
from undertow.sandboxes.datasets.images import how_to_get
from undertow.sandboxes.datasets.importer import import_dataset
from undertow.sandboxes.task import load_tasks
from undertow.sandboxes.task_image import compute_base_commit, prepare_testbed
from undertow.sandboxes.taskset import check_stamps, stamp_task_set


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("name", sorted(dataset_rows.ROWS))
def test_every_dataset_imports_and_loads(name, tmp_path):
    source = _write_jsonl(tmp_path / "rows.jsonl", dataset_rows.ROWS[name])
    report = import_dataset(name, source, tmp_path / "out")
    tasks = load_tasks(tmp_path / "out")
    assert report.num_rows == len(dataset_rows.ROWS[name])
    assert report.num_kept == len(tasks) >= 1
    assert report.num_rows - report.num_kept == sum(report.dropped.values())
    assert all(task.image and task.FAIL_TO_PASS for task in tasks)


def test_swe_bench_rows_take_the_official_harness_where_it_knows_the_repository(tmp_path):
    source = _write_jsonl(tmp_path / "rows.jsonl", dataset_rows.SWE_BENCH)
    report = import_dataset("swe-bench", source, tmp_path / "out")
    assert report.dropped == dataset_rows.SWE_BENCH_DROPPED
    tasks = {task.instance_id: task for task in load_tasks(tmp_path / "out")}
    assert list(tasks) == dataset_rows.SWE_BENCH_KEPT
    django = tasks["django__django-11099"]
    assert django.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert (django.log_parser, django.version) == ("swebench", "3.0")
    assert django.timeout_s == 1800.0
    assert django.environment_setup_commit == "b" * 40
    assert django.test_cmd.startswith("./tests/runtests.py") and "test_new" in django.test_cmd
    assert "conda activate testbed" in django.eval_commands
    assert tasks["sympy__sympy-20590"].log_parser == "swebench"
    unknown = tasks["acme__widgets-7"]
    assert unknown.log_parser == "pytest"
    assert unknown.test_cmd.endswith("-p no:cacheprovider tests/test_new.py")


def test_each_dataset_names_its_images(tmp_path):
    expected = {
        "swe-gym": "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5752:latest",
        "swe-smith": "jyangballin/swesmith.x86_64.getmoto_1776_moto.694ce1f4",
        "r2e-gym": f"namanjain12/orange3_final:{'d' * 40}",
        "swe-rebench": "swerebench/sweb.eval.x86_64.owner_1776_lib-12",
        "swe-bench-multilingual": "swebench/sweb.eval.x86_64.caddyserver_1776_caddy-6411:latest",
    }
    for name, image in expected.items():
        source = _write_jsonl(tmp_path / f"{name}.jsonl", dataset_rows.ROWS[name])
        import_dataset(name, source, tmp_path / name)
        assert load_tasks(tmp_path / name)[0].image == image
    assert load_tasks(tmp_path / "swe-gym")[1].image == (
        "xingyaoww/sweb.eval.x86_64.project-monai_s_monai-2696:latest")
    smith = load_tasks(tmp_path / "swe-smith")[1]
    assert smith.image == "jyangballin/swesmith.x86_64.pallets_1776_flask.bc098406"
    assert smith.start_commands[-1] == "git checkout -q pallets__flask.bc098406.lm_rewrite__xyz"
    assert (smith.pre_install, smith.base_commit) == ((), "pallets__flask.bc098406.lm_rewrite__xyz")
    rebench = load_tasks(tmp_path / "swe-rebench")
    assert rebench[0].log_parser == "swebench:parse_log_pytest"
    assert rebench[0].pre_install == ("apt-get update",)
    assert rebench[1].log_parser == "pytest"
    r2e = load_tasks(tmp_path / "r2e-gym")
    assert r2e[0].FAIL_TO_PASS == ("r2e_tests/test_1.py::test_a",)
    assert r2e[1].image == f"namanjain12/pillow_final:{'e' * 40}"


def test_image_template_and_registry_override(tmp_path):
    source = _write_jsonl(tmp_path / "rows.jsonl", dataset_rows.SWE_SMITH)
    import_dataset("swe-smith", source, tmp_path / "a", registry="mirror.local:5000/")
    assert load_tasks(tmp_path / "a")[0].image == (
        "mirror.local:5000/jyangballin/swesmith.x86_64.getmoto_1776_moto.694ce1f4")
    import_dataset("swe-smith", source, tmp_path / "b", image_template="m/{instance_id_lower}")
    assert load_tasks(tmp_path / "b")[0].image == "m/getmoto__moto.694ce1f4.func_pm_op_swap__abc"
    with pytest.raises(ValueError, match="uses 'nope'"):
        import_dataset("swe-smith", source, tmp_path / "c", image_template="{nope}")


def test_hugging_face_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = dataset_rows.SWE_BENCH[:3]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "hf"))
    report = import_dataset("swe-bench-lite", tmp_path / "hf", tmp_path / "out")
    assert (report.num_rows, report.num_kept) == (3, 3)
    (tmp_path / "parquet" / "data").mkdir(parents=True)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "parquet" / "data" /
                                                    "test-00000-of-00001.parquet"))
    report = import_dataset("swe-bench-verified", tmp_path / "parquet", tmp_path / "out2")
    assert (report.num_rows, report.num_kept) == (3, 3)
    assert load_tasks(tmp_path / "out2")[0].log_parser == "swebench"


def test_missing_image_names_the_command():
    task = load_tasks_from_rows("swe-bench-verified", dataset_rows.SWE_BENCH[:1])[0]
    message = how_to_get(task, FORMATS["swe-bench-verified"])
    assert "swebench/sweb.eval.x86_64.django_1776_django-11099:latest is not on this" in message
    assert "docker pull swebench/sweb.eval.x86_64.django_1776_django-11099:latest" in message
    assert "--dataset_name SWE-bench/SWE-bench_Verified --instance_ids django__django-11099" in (
        message)


def load_tasks_from_rows(name, rows):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as scratch:
        source = _write_jsonl(Path(scratch) / "rows.jsonl", rows)
        import_dataset(name, source, Path(scratch) / "out")
        return load_tasks(Path(scratch) / "out")


def test_import_command_reports_kept_and_dropped(tmp_path, capsys):
    source = _write_jsonl(tmp_path / "rows.jsonl", dataset_rows.SWE_BENCH)
    assert main(["tasks", "import", "swe-bench", "--from", str(source), "--out",
                 str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "swe-bench: kept 3 of 6 rows" in out
    assert "1 no FAIL_TO_PASS tests" in out and "1 repeats an earlier instance_id" in out
    assert main(["tasks", "import", "nope", "--from", str(source), "--out",
                 str(tmp_path / "x")]) == 2
    assert "unknown dataset 'nope'" in capsys.readouterr().err


BUGGY_CALC = "def double(x):\n    return x + 1\n"
FIXED_CALC = "def double(x):\n    return 2 * x\n"
CALC_TEST = "from calc import double\n\n\ndef test_double():\n    assert double(3) == 6\n"


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout


def _row_over_a_local_clone(data):
    """`data/repos/calc`, a clone whose base commit has the bug and whose next commit fixes
    it (as a clone of a real project holds its later history), and a SWE-bench row over it
    (`source_dir` relative to the rows' folder); the row's base commit and the fix's."""
    repo = data / "repos" / "calc"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    (repo / "calc.py").write_text(BUGGY_CALC)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc.py").write_text(FIXED_CALC)
    _git(repo, "commit", "-qam", "fix")
    fix = _git(repo, "rev-parse", "HEAD").strip()
    patch = _git(repo, "diff", base, fix)
    (repo / "test_calc.py").write_text(CALC_TEST)
    _git(repo, "add", "-N", "test_calc.py")
    test_patch = _git(repo, "diff", "--", "test_calc.py")
    _git(repo, "rm", "-q", "--cached", "test_calc.py")
    (repo / "test_calc.py").unlink()
    row = dataset_rows.swe_bench_row("acme__calc-1", "acme/calc", "0.1",
                                     ["test_calc.py::test_double"], base_commit=base,
                                     patch=patch, test_patch=test_patch, source_dir="repos/calc")
    _write_jsonl(data / "rows.jsonl", [row])
    return row, fix


def test_rows_over_a_local_repository_keep_their_source_and_base_commit(tmp_path):
    row, fix = _row_over_a_local_clone(tmp_path / "data")
    assert main(["tasks", "import", "swe-bench", "--from", str(tmp_path / "data" / "rows.jsonl"),
                 "--out", str(tmp_path / "out")]) == 0
    [task] = load_tasks(tmp_path / "out")
    assert task.image is None and task.base_commit == row["base_commit"]
    assert task.source_dir == (tmp_path / "data" / "repos" / "calc").resolve()
    assert [s.matches for s in check_stamps(tmp_path / "out")] == [True]
    stamp_task_set(tmp_path / "out")   # the task-set route: stamping keeps it as given
    assert load_tasks(tmp_path / "out")[0].base_commit == row["base_commit"]

    testbed = tmp_path / "testbed"
    assert prepare_testbed(task, testbed) == row["base_commit"] == compute_base_commit(task)
    assert (testbed / "calc.py").read_text() == BUGGY_CALC
    assert _git(testbed, "rev-list", "--all", "--count").strip() == "1"
    missing = subprocess.run(["git", "cat-file", "-e", fix], cwd=testbed, capture_output=True)
    assert missing.returncode != 0   # the fix is not in the testbed's history


@pytest.mark.docker
def test_a_row_over_a_local_repository_builds_runs_and_grades(tmp_path, docker_connection,
                                                              docker_run, base_image):
    from undertow.sandboxes.grading import grade
    from undertow.sandboxes.sandbox import Sandbox
    from undertow.sandboxes.task_image import ensure_task_image

    row, _ = _row_over_a_local_clone(tmp_path / "data")
    import_dataset("swe-bench", tmp_path / "data" / "rows.jsonl", tmp_path / "out")
    [task] = load_tasks(tmp_path / "out")

    async def build_run_and_grade():
        image = await ensure_task_image(docker_connection, task)
        async with await Sandbox.start(docker_connection, image, run=docker_run,
                                       session="local-repo",
                                       base_commit=task.base_commit) as sandbox:
            head = await sandbox.exec("git rev-parse HEAD; cat calc.py", timeout_s=30)
        gold = await grade(docker_connection, task, task.patch, run=docker_run, image=image)
        empty = await grade(docker_connection, task, "", run=docker_run, image=image)
        return head.output, gold, empty

    head, gold, empty = asyncio.run(build_run_and_grade())
    assert head == f"{row['base_commit']}\n{BUGGY_CALC}"
    assert (gold.reward, empty.reward) == (1.0, 0.0), (gold.reason, gold.log_tail)


@pytest.mark.docker
def test_check_images_names_each_missing_image_and_its_command(tmp_path, capsys):
    source = _write_jsonl(tmp_path / "rows.jsonl", dataset_rows.SWE_GYM)
    assert main(["tasks", "import", "swe-gym", "--from", str(source), "--out",
                 str(tmp_path / "out"), "--registry", "mirror.invalid", "--check-images"]) == 1
    out = capsys.readouterr().out
    image = "mirror.invalid/xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5752:latest"
    assert f"task getmoto__moto-5752: image {image} is not on this Docker host" in out
    assert f"get it with: docker pull {image}" in out and "0/2 images on this Docker host" in out
