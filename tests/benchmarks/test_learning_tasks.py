"""The generated SWE task family of the held-out learning benchmark
(`benchmarks/learning_tasks.py`)."""

import pytest

from benchmarks.learning_tasks import SITES, draw_instances, generate, split_instances
from undertow.cli import main
from undertow.sandboxes.task import load_tasks


def _files(folder):
    return {path.relative_to(folder): path.read_bytes()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_instances_need_different_edits_and_split_by_instance():
    instances = draw_instances(60, seed=3)
    assert len({instance.instance_id for instance in instances}) == 60
    assert {instance.site for instance in instances} == set(SITES)
    assert len({(instance.site.path, instance.right) for instance in instances}) > 50
    train, heldout = split_instances(instances, 0.25, seed=3)
    assert (len(train), len(heldout)) == (45, 15)
    assert not {i.instance_id for i in train} & {i.instance_id for i in heldout}
    assert {i.site for i in train} == set(SITES)


def test_generation_is_deterministic_and_each_statement_names_its_fix(tmp_path):
    first = generate(tmp_path / "a", num_instances=8, seed=5, heldout_fraction=0.25)
    second = generate(tmp_path / "b", num_instances=8, seed=5, heldout_fraction=0.25)
    for one, two in zip(first, second, strict=True):
        assert _files(one) == _files(two)
    instances = {i.instance_id: i for i in draw_instances(8, seed=5)}
    tasks = [*load_tasks(first[0]), *load_tasks(first[1])]
    assert len(tasks) == 8 and len(load_tasks(first[1])) == 2
    for task in tasks:
        instance = instances[task.instance_id]
        assert len(task.base_commit) == 40
        removed, added = (
            [line[1:] for line in task.patch.splitlines()[3:] if line.startswith(sign)]
            for sign in "-+")
        assert removed == [line.replace(str(instance.right), str(instance.wrong))
                           for line in added]
        assert str(instance.right) in added[0]
        assert f"uses {instance.wrong} instead of {instance.right}" in task.problem_statement


@pytest.mark.docker
def test_two_generated_tasks_pass_validation(tmp_path, capsys):
    train, _ = generate(tmp_path / "tasks", num_instances=4, seed=0, heldout_fraction=0.5)
    argv = ["tasks", "validate", str(train), "--runs", "1"]
    for task in load_tasks(train)[:2]:
        argv += ["--task", task.instance_id]
    assert main(argv) == 0
    assert "2/2 tasks valid" in capsys.readouterr().out
