"""`undertow train` without `--resume` (`undertow/run/train.py`): refused only where the run
directory holds a whole checkpoint; a `checkpoints/` a run left empty (it died before its
first) or holding only a half-written temporary does not stop a new start."""

import threading
from pathlib import Path

import pytest

from undertow.run.sections import load_sections
from undertow.run.train import train


def _sections(run_dir: Path):
    # A model directory that does not exist: a start that gets past the guard stops there.
    return load_sections(None, [f"run.model_dir={run_dir.parent / 'no-model'}"], run_dir)


def test_a_run_directory_with_a_checkpoint_needs_resume(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-000002").mkdir(parents=True)
    with pytest.raises(ValueError, match="already holds checkpoints; pass --resume"):
        train(_sections(run_dir), False, threading.Event())


@pytest.mark.parametrize("leftover", ["", ".tmp-step-000002-12345"])
def test_an_empty_checkpoints_folder_does_not_refuse_a_new_start(tmp_path, leftover):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / leftover).mkdir(parents=True)
    with pytest.raises(ValueError, match="holds no model"):
        train(_sections(run_dir), False, threading.Event())
