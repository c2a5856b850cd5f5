"""Dataset loaders and `undertow tasks import`, on fixture rows of each dataset's shape."""

import json

import pytest

from tests.sandboxes import dataset_rows
from undertow.cli import main
from undertow.sandboxes.datasets.formats import FORMATS
from undertow.sandboxes.datasets.images import how_to_get
from undertow.sandboxes.datasets.importer import import_dataset
from undertow.sandboxes.task import load_tasks


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


@pytest.mark.docker
def test_check_images_names_each_missing_image_and_its_command(tmp_path, capsys):
    source = _write_jsonl(tmp_path / "rows.jsonl", dataset_rows.SWE_GYM)
    assert main(["tasks", "import", "swe-gym", "--from", str(source), "--out",
                 str(tmp_path / "out"), "--registry", "mirror.invalid", "--check-images"]) == 1
    out = capsys.readouterr().out
    image = "mirror.invalid/xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5752:latest"
    assert f"task getmoto__moto-5752: image {image} is not on this Docker host" in out
    assert f"get it with: docker pull {image}" in out and "0/2 images on this Docker host" in out
