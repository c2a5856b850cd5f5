"""The composition root's config (`undertow/run/sections.py`): one typed `RunSections` built
from the config tree, the checkpoint's `resolved` form of it, and the resume path."""

from pathlib import Path

import pytest
import yaml

from undertow.cells.config import CellPoolConfig
from undertow.config import read_config
from undertow.learner.config import AdvantageConfig, LossConfig, TrackerConfig, TrainConfig
from undertow.run.sections import (
    CONFIGS_DIR,
    RolloutSection,
    RunConfig,
    RunSections,
    WarmStartSection,
    load_sections,
    section_names,
)
from undertow.sandboxes.hosts import HostsConfig
from undertow.sandboxes.sandbox import SandboxConfig

EVERY_SECTION = """\
run: {run_dir: runs/x, model_dir: /models/m, engine_urls: [http://e:1], docker_url: tcp://d:2}
rollout: {scaffold: chat, tasks: t.yaml, instance_ids: [a, b], concurrency: 3,
          scaffold_options: {max_tokens: 8}, sandbox: {memory_bytes: 1073741824}}
learner: {num_steps: 5, lr: 3e-3, micro_batch_tokens: auto}
loss: {clip_high: 0.3}
advantages: {eps: 0.5}
warm_start: {num_steps: 0}
logging: {run_name: named}
sandbox: {docker_hosts: [unix:///a.sock, ssh://b], max_sessions_per_host: 4}
pool: {num_cells: 3}
"""


def test_every_section_is_built_into_its_parts_dataclass():
    sections = RunSections.from_tree(yaml.safe_load(EVERY_SECTION))
    assert sections == RunSections(
        run=RunConfig(Path("runs/x"), Path("/models/m"), ("http://e:1",), "tcp://d:2"),
        rollout=RolloutSection(scaffold="chat", tasks=Path("t.yaml"), instance_ids=("a", "b"),
                               concurrency=3, scaffold_options={"max_tokens": 8},
                               sandbox=SandboxConfig(memory_bytes=2**30)),
        learner=TrainConfig(num_steps=5, lr=0.003, micro_batch_tokens="auto"),
        loss=LossConfig(clip_high=0.3), advantages=AdvantageConfig(eps=0.5),
        warm_start=WarmStartSection(num_steps=0), logging=TrackerConfig(run_name="named"),
        sandbox=HostsConfig(docker_hosts=("unix:///a.sock", "ssh://b"),
                            max_sessions_per_host=4),
        pool=CellPoolConfig(num_cells=3))
    assert set(section_names()) == set(yaml.safe_load(EVERY_SECTION))


def test_a_missing_section_takes_its_defaults_and_no_pool_section_means_no_pool():
    sections = RunSections.from_tree({"learner": {"num_steps": 3}})
    assert sections.learner == TrainConfig(num_steps=3)
    assert sections.rollout == RolloutSection() and sections.run == RunConfig()
    assert sections.pool is None
    assert RunSections.from_tree({}) == RunSections()
    assert RunSections.from_tree({"pool": None}).pool == CellPoolConfig()   # `pool:` alone


def test_an_unknown_section_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown config section\(s\) \['lerner'\]; known: "
                                         r"\['run', 'rollout', 'warm_start'"):
        RunSections.from_tree({"lerner": {"num_steps": 3}})


@pytest.mark.parametrize(("tree", "message"), [
    ({"learner": {"num_step": 3}}, r"\[learner\] unknown keys \['num_step'\] \(learner.num_step\)"),
    ({"pool": {"cells": 2}}, r"\(pool.cells\)"),
    ({"rollout": {"sandbox": {"mem": 1}}}, r"\(rollout.sandbox.mem\)"),
    ({"loss": {"clip_low": "wide"}}, r"loss.clip_low: expected float, got 'wide'"),
    ({"run": "runs/x"}, r"run: expected a mapping of RunConfig's fields, got 'runs/x'"),
])
def test_a_bad_key_or_value_in_a_section_is_named_by_its_dotted_key(tree, message):
    with pytest.raises(ValueError, match=message):
        RunSections.from_tree(tree)


def test_the_file_then_the_overrides_then_run_dir(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learner: {num_steps: 4, group_size: 3}\nrun: {run_dir: elsewhere}\n")
    sections = load_sections(path, ["learner.num_steps=7", "rollout.sandbox.num_cpus=2"],
                             run_dir=tmp_path / "run")
    assert (sections.learner.num_steps, sections.learner.group_size) == (7, 3)
    assert sections.rollout.sandbox.num_cpus == 2.0
    assert sections.run.run_dir == tmp_path / "run"


def test_without_a_file_the_run_reads_the_default_config():
    sections = load_sections(None, [])
    assert sections == RunSections.from_tree(read_config(CONFIGS_DIR / "learn.yaml"))
    assert sections.rollout.scaffold == "chat"


def test_a_resume_without_a_file_reads_the_latest_checkpoints_config_then_the_overrides(
        tmp_path):
    run_dir = tmp_path / "run"
    stored = RunSections.from_tree({"run": {"run_dir": str(run_dir)},
                                    "learner": {"num_steps": 9, "group_size": 5}})
    for name, num_steps in (("step-000001", 1), ("step-000002", 9)):
        checkpoint = run_dir / "checkpoints" / name
        checkpoint.mkdir(parents=True)
        tree = stored.resolved
        tree["learner"]["num_steps"] = num_steps
        (checkpoint / "config.yaml").write_text(yaml.safe_dump(tree))
    resumed = load_sections(None, ["learner.num_steps=12"], run_dir=run_dir, resume=True)
    assert resumed.learner == TrainConfig(num_steps=12, group_size=5)   # not learn.yaml's
    assert resumed.rollout == RolloutSection()   # the checkpoint's, not learn.yaml's chat
    # with a file given, or without --resume, the checkpoint is not read
    assert load_sections(None, [], run_dir=run_dir).rollout.scaffold == "chat"


def test_a_resume_of_a_run_without_checkpoints_reads_the_default_config(tmp_path):
    sections = load_sections(None, [], run_dir=tmp_path / "new", resume=True)
    assert sections.rollout.scaffold == "chat"


@pytest.mark.parametrize("source", ["every", "learn.yaml", "swe.yaml", "cluster.yaml",
                                    "cluster-ray.yaml"])
def test_resolved_is_yaml_safe_and_builds_the_same_sections(source):
    tree = yaml.safe_load(EVERY_SECTION) if source == "every" else \
        read_config(CONFIGS_DIR / source)
    sections = RunSections.from_tree(tree)
    resolved = sections.resolved
    assert set(resolved) == set(section_names()) - ({"pool"} if sections.pool is None else set())
    stored = yaml.safe_load(yaml.safe_dump(resolved))   # what the checkpoint writes and reads
    assert stored == resolved
    assert RunSections.from_tree(stored) == sections
