"""The generated SWE task family of the held-out learning benchmark
(`benchmarks/learning_tasks.py`)."""

import pytest

from benchmarks.learning_tasks import (
    DIFFICULTIES,
    SITES,
    draw_instances,
    generate,
    problem_statement,
    split_instances,
)
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


def test_difficulty_changes_only_the_statement(tmp_path):
    folders = {name: generate(tmp_path / name, num_instances=6, seed=2, difficulty=name)
               for name in DIFFICULTIES}
    tasks = {name: {t.instance_id: t for t in [*load_tasks(train), *load_tasks(heldout)]}
             for name, (train, heldout) in folders.items()}
    for name, (train, heldout) in folders.items():  # same repositories, patches and tests
        assert _files(train / "repos") == _files(folders["numbers"][0] / "repos")
        assert _files(heldout / "repos") == _files(folders["numbers"][1] / "repos")
        for instance_id, task in tasks[name].items():
            assert (task.patch, task.test_patch) == (tasks["numbers"][instance_id].patch,
                                                     tasks["numbers"][instance_id].test_patch)
    for instance in draw_instances(6, seed=2):
        line = next(t for t in tasks["line"].values() if t.instance_id == instance.instance_id)
        removed, added = (next(row[1:].strip() for row in line.patch.splitlines()[3:]
                               if row.startswith(sign)) for sign in "-+")
        assert f"the line `{removed}` should read `{added}`" in line.problem_statement
        call = problem_statement(instance, "call")
        assert instance.site.path not in call and "instead of" not in call
        assert f"I expected {instance.site.expected(instance.right)!r}." in call
    with pytest.raises(ValueError, match="difficulty='easy'"):
        generate(tmp_path / "bad", num_instances=4, difficulty="easy")


@pytest.mark.docker
def test_two_generated_tasks_pass_validation(tmp_path, capsys):
    train, _ = generate(tmp_path / "tasks", num_instances=4, seed=0, heldout_fraction=0.5)
    argv = ["tasks", "validate", str(train), "--runs", "1"]
    for task in load_tasks(train)[:2]:
        argv += ["--task", task.instance_id]
    assert main(argv) == 0
    assert "2/2 tasks valid" in capsys.readouterr().out
