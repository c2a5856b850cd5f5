"""Checkpoints: a round trip restores weights, optimizer, step, RNG and pending groups
exactly; a failed write leaves no trace and names its file and cause (a real full disk: a
small tmpfs); hidden temporaries are never read back; a damaged checkpoint is named and set
aside and the one before restored; what a dead start left is cleared; starts are numbered
for good."""

import contextlib
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from undertow.gateway.trees.tree import tree_to_json
from undertow.learner.checkpoint import (
    STARTS_FILE,
    CheckpointError,
    PendingGroup,
    check_checkpoint,
    clear_dead_start,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    record_start,
    restorable_checkpoint,
)
from undertow.learner.config import AdvantageConfig, LossConfig, TrainConfig
from undertow.learner.train import Learner

from .conftest import build_random_tree

pytestmark = pytest.mark.slow


def _learner(tiny_model_dir, run_dir):
    return Learner(TrainConfig(lr=1e-3, keep_checkpoints=3), LossConfig(), AdvantageConfig(),
                   tiny_model_dir, run_dir, resolved_config={"learner": {"lr": 1e-3}})


def _parameters(learner):
    return {name: p.detach().clone() for name, p in learner.policy.model.named_parameters()}


def test_round_trip_restores_weights_optimizer_step_rng_and_pending(tiny_model_dir, tmp_path):
    learner = _learner(tiny_model_dir, tmp_path)
    learner.train_step([build_random_tree(3, "g-a")])
    learner.pending = [PendingGroup(7, build_random_tree(4, "g-b"), rollout_s=1.5)]
    learner.state.num_launched, learner.state.consumed = 8, [0]
    torch.manual_seed(123)
    random.seed(5)
    path = learner.save(checkpoint=True)
    expected_draws = (torch.rand(3), random.random())

    restored = Learner.restore(learner.config, learner.loss, learner.advantage_config,
                               tiny_model_dir, tmp_path)
    assert (torch.rand(3).tolist(), random.random()) == (expected_draws[0].tolist(),
                                                         expected_draws[1])
    assert path.parent.name == "step-000001"
    assert restored.state.step == 1 and restored.state.num_launched == 8
    assert restored.state.consumed == [0] and restored.state.num_resumes == 1
    for name, value in _parameters(learner).items():
        assert torch.equal(dict(restored.policy.model.named_parameters())[name], value), name
    before, after = learner.optimizer.state_dict(), restored.optimizer.state_dict()
    assert before["param_groups"] == after["param_groups"]
    for key, state in before["state"].items():
        for field, value in state.items():
            assert torch.equal(after["state"][key][field], value), (key, field)
    (pending,) = restored.pending
    assert pending.index == 7 and pending.rollout_s == 1.5
    assert tree_to_json(pending.tree) == tree_to_json(learner.pending[0].tree)


def test_the_model_directory_loads_with_transformers(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    learner = _learner(tiny_model_dir, tmp_path)
    learner.train_step([build_random_tree(3, "g-a")])
    model_dir = learner.save(checkpoint=True)
    assert (model_dir / "model.safetensors").exists()
    assert (model_dir.parent / "config.yaml").read_text().strip() == "learner:\n  lr: 0.001"
    loaded = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for name, value in _parameters(learner).items():
        assert torch.equal(dict(loaded.named_parameters())[name], value), name
    assert AutoTokenizer.from_pretrained(str(model_dir)).encode("def f(): pass")


def test_a_failed_write_leaves_the_previous_checkpoint_latest(tiny_model_dir, tmp_path):
    learner = _learner(tiny_model_dir, tmp_path)
    first = learner.save(checkpoint=True).parent
    learner.train_step([build_random_tree(3, "g-a")])
    learner.resolved_config = {"unserialisable": object()}
    with pytest.raises(Exception, match="represent"):
        learner.save(checkpoint=True)
    assert latest_checkpoint(tmp_path) == first
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [first.name]


def test_a_hidden_temporary_is_ignored_and_a_second_save_gets_a_serial(tiny_model_dir,
                                                                      tmp_path):
    learner = _learner(tiny_model_dir, tmp_path)
    first = learner.save(checkpoint=True).parent
    torn = tmp_path / "checkpoints" / ".tmp-step-000005-999"
    torn.mkdir()
    (torn / "state.json").write_text("{")
    second = learner.save(checkpoint=True).parent
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000", "step-000000.1"]
    assert latest_checkpoint(tmp_path) == second != first
    assert load_checkpoint(second, restore_rng=False).state.step == 0


def test_only_the_newest_checkpoints_are_kept(tiny_model_dir, tmp_path):
    learner = _learner(tiny_model_dir, tmp_path)
    for _ in range(4):
        learner.state.step += 1
        learner.save(checkpoint=True)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-000002", "step-000003", "step-000004"]


def test_a_resume_saves_its_weights_past_a_dead_starts_later_folders(tiny_model_dir,
                                                                       tmp_path):
    """A dead start left weights/step-000011..15; the resumed run, at step 10, writes
    step 11: the folder it pushes must be the one it wrote, and whole."""
    learner = _learner(tiny_model_dir, tmp_path)
    for step in range(9, 16):
        (tmp_path / "weights" / f"step-{step:06d}").mkdir(parents=True)
    learner.state.step = 11
    pushed = learner.save(checkpoint=False)
    assert (pushed / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [
        "step-000010", pushed.name]


def test_a_dead_start_leaves_nothing_in_the_way(tiny_model_dir, tmp_path):
    """Its weights past the step resumed go, and the temporaries of dead processes; a live
    process's temporary stays."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftovers = [tmp_path / "checkpoints" / f".tmp-step-000012-{dead.pid}",
                 tmp_path / "weights" / f".tmp-step-000013-{dead.pid}",
                 tmp_path / "weights" / "step-000011", tmp_path / "weights" / "step-000012"]
    kept = [tmp_path / "weights" / "step-000010",
            tmp_path / "weights" / f".tmp-step-000011-{os.getppid()}"]
    for path in leftovers + kept:
        path.mkdir(parents=True)
    clear_dead_start(tmp_path, 10)
    assert [path.exists() for path in leftovers + kept] == [False] * 4 + [True] * 2


def _damage(checkpoint: Path, name: str) -> None:
    path = checkpoint / name
    if name.endswith(".json"):
        path.write_text('{"step": 4, "num_la')
    else:
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("name", ["model/model.safetensors", "trainer.pt", "state.json",
                                  "pending.json"])
def test_a_damaged_checkpoint_is_named_set_aside_and_the_one_before_restored(
        tiny_model_dir, tmp_path, name):
    learner = _learner(tiny_model_dir, tmp_path)
    learner.train_step([build_random_tree(3, "g-a")])
    intact = learner.save(checkpoint=True).parent
    learner.train_step([build_random_tree(3, "g-b")])
    damaged = learner.save(checkpoint=True).parent
    _damage(damaged, name)
    with pytest.raises(CheckpointError, match=re.escape(str(damaged / name))):
        check_checkpoint(damaged)

    reports: list[str] = []
    assert restorable_checkpoint(tmp_path, reports.append) == intact
    (report,) = reports
    assert str(damaged / name) in report and "resumes from the checkpoint before it" in report
    assert list_checkpoints(tmp_path) == [intact] and not damaged.exists()
    assert len(list((tmp_path / "checkpoints").glob(".damaged-step-000002-*"))) == 1
    restored = Learner.restore(learner.config, learner.loss, learner.advantage_config,
                               tiny_model_dir, tmp_path)
    assert restored.state.step == 1 and restored.restored_from == intact


def test_a_file_unreadable_at_load_is_named(tiny_model_dir, tmp_path):
    learner = _learner(tiny_model_dir, tmp_path)
    path = learner.save(checkpoint=True).parent
    (path / "pending.json").write_text('[{"index": 1}]')   # valid JSON, not a group
    with pytest.raises(CheckpointError, match=r"pending\.json cannot be read: KeyError"):
        load_checkpoint(path, restore_rng=False)


@contextlib.contextmanager
def _small_disk(path: Path, size: str):
    """A tmpfs of `size` at `path`: a disk that fills for real (needs root, else skips)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.parametrize(("size", "file_name"), [("4m", "model.safetensors"),
                                                 ("30m", "trainer.pt")])
def test_a_full_disk_while_saving_names_enospc_and_the_file(tiny_model_dir, tmp_path, size,
                                                            file_name):
    with _small_disk(tmp_path / "disk", size) as run_dir:
        learner = _learner(tiny_model_dir, run_dir)
        learner.train_step([build_random_tree(3, "g-a")])   # the optimizer's state: 2x
        with pytest.raises(CheckpointError) as raised:
            learner.save(checkpoint=True)
        message = str(raised.value)
        assert "ENOSPC" in message and file_name in message, message
        assert str(run_dir / "checkpoints" / "step-000001") in message
        assert list((run_dir / "checkpoints").iterdir()) == []   # no trace


def test_starts_are_numbered_for_good_before_any_group(tmp_path):
    """The group IDs' `-rN`: a start that dies before its first checkpoint keeps its
    number; the checkpoint's count plus one is a floor."""
    assert record_start(tmp_path, 0) == 0            # the first run
    assert record_start(tmp_path, 1) == 1            # resumed from its checkpoint (r0)
    assert record_start(tmp_path, 1) == 2            # that start died: same checkpoint
    assert record_start(tmp_path, 5) == 5
    assert json.loads((tmp_path / STARTS_FILE).read_text()) == {"num_starts": 6}


def test_saving_prints_no_progress_bar_and_leaves_transformers_as_it_was(tiny_model_dir,
                                                                           tmp_path, capfd):
    from transformers.utils import logging as transformers_logging

    learner = _learner(tiny_model_dir, tmp_path)
    assert transformers_logging.is_progress_bar_enabled()
    learner.save(checkpoint=False)
    learner.save(checkpoint=True)
    output = capfd.readouterr()
    assert "Writing model shards" not in output.out + output.err
    assert transformers_logging.is_progress_bar_enabled()
