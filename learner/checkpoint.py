"""Checkpoints of a training run, written atomically, and the model directories the engines load.

Layout of a run directory:

    RUN/checkpoints/step-000002/      one checkpoint (a later save at the same step: step-000002.1)
        model/                        Hugging Face layout: config.json, model.safetensors,
                                      tokenizer files, generation_config.json
        config.yaml                   the resolved run configuration
        trainer.pt                    optimizer state and RNG states (torch, python)
        state.json                    `TrainState`: step, groups launched and consumed
        pending.json                  groups collected but not yet trained (their trees)
    RUN/weights/step-000003/          a model directory written only to push it (steps
                                      between checkpoints); the last two are kept
    RUN/metrics.jsonl                 per-step metrics (`metrics_log.py`)

Atomicity: a checkpoint is written into a hidden `.tmp-*` directory, every file is
fsync'ed, then one `rename` makes it visible; readers ignore hidden directories, so a
crash mid-write leaves the previous checkpoint as the latest. A checkpoint is never
overwritten: a second save at the same step gets a serial suffix.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from undertow.gateway.trees.template_env import CHAT_TEMPLATE_DIR
from undertow.gateway.trees.tree import tree_from_json, tree_to_json
from undertow.learner.causal_lm import CausalLM

CHECKPOINTS = "checkpoints"
WEIGHTS = "weights"
_NAME = re.compile(r"^step-(\d{6})(?:\.(\d+))?$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


@dataclass
class TrainState:
    """Where a run stands. `step` optimizer steps are done, so the weights are version
    `step`. Groups are numbered in launch order: `num_launched` were launched, and
    `consumed` lists those trained or dropped; the rest were in flight or pending when
    the checkpoint was written (pending ones are saved in `pending.json`, in-flight ones
    are launched again on resume, under a new group ID)."""

    step: int = 0
    num_launched: int = 0
    consumed: list[int] = field(default_factory=list)
    num_resumes: int = 0


@dataclass
class PendingGroup:
    """A finished group not yet trained: its launch index and tree."""

    index: int
    tree: Any
    rollout_s: float = 0.0


@dataclass
class Checkpoint:
    """A loaded checkpoint (model weights are read from `model_dir` by the caller)."""

    path: Path
    state: TrainState
    pending: list[PendingGroup]

    @property
    def model_dir(self) -> Path:
        return self.path / "model"


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_model_dir(model: CausalLM, base_model_dir: Path, out: Path) -> Path:
    """Saves `model` in Hugging Face layout (safetensors) with the tokenizer files of
    `base_model_dir`, so that transformers and the engines load `out` as a model."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in _TOKENIZER_FILES:
        source = Path(base_model_dir) / name
        if source.exists() and not (out / name).exists():
            shutil.copy2(source, out / name)
    named = Path(base_model_dir) / CHAT_TEMPLATE_DIR
    if named.is_dir() and not (out / named.name).exists():
        shutil.copytree(named, out / named.name)
    return out


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])


def _atomic_dir(final: Path, fill) -> Path:
    """Creates `final` atomically: `fill(tmp)` writes a hidden directory, then rename."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        fill(tmp)
        _fsync_tree(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_tree(final.parent)
    return final


def _free_name(parent: Path, step: int) -> Path:
    path, serial = parent / f"step-{step:06d}", 0
    while path.exists():
        serial += 1
        path = parent / f"step-{step:06d}.{serial}"
    return path


def save_checkpoint(run_dir: Path, state: TrainState, model: CausalLM,
                    optimizer: torch.optim.Optimizer, base_model_dir: Path,
                    resolved_config: dict[str, Any], pending: list[PendingGroup],
                    keep: int = 2) -> Path:
    """Writes a checkpoint of `state` atomically; keeps the newest `keep`. Returns it."""
    def fill(tmp: Path) -> None:
        write_model_dir(model, base_model_dir, tmp / "model")
        (tmp / "config.yaml").write_text(yaml.safe_dump(resolved_config, sort_keys=True))
        torch.save({"optimizer": optimizer.state_dict(), "rng": _rng_state()},
                   tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps(asdict(state), indent=1))
        (tmp / "pending.json").write_text(json.dumps(
            [{"index": g.index, "rollout_s": g.rollout_s, "tree": tree_to_json(g.tree)}
             for g in pending]))

    parent = Path(run_dir) / CHECKPOINTS
    path = _atomic_dir(_free_name(parent, state.step), fill)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def save_weights(run_dir: Path, step: int, model: CausalLM, base_model_dir: Path,
                 keep: int = 2) -> Path:
    """Writes the model directory of weight version `step` (for the engines) atomically."""
    parent = Path(run_dir) / WEIGHTS
    path = _atomic_dir(_free_name(parent, step),
                       lambda tmp: write_model_dir(model, base_model_dir, tmp))
    for old in _sorted_dirs(parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _sorted_dirs(parent: Path) -> list[Path]:
    found = []
    for path in parent.glob("step-*") if parent.is_dir() else []:
        match = _NAME.match(path.name)
        if match and path.is_dir():
            found.append(((int(match.group(1)), int(match.group(2) or 0)), path))
    return [path for _, path in sorted(found)]


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    return _sorted_dirs(Path(run_dir) / CHECKPOINTS)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_checkpoint(path: Path, optimizer: torch.optim.Optimizer | None = None,
                    restore_rng: bool = True) -> Checkpoint:
    """Reads a checkpoint; loads the optimizer state into `optimizer` (whose parameters
    must be those of a model loaded from `path/model`) and restores the RNG states."""
    path = Path(path)
    state = TrainState(**json.loads((path / "state.json").read_text()))
    trainer = torch.load(path / "trainer.pt", weights_only=True)
    if optimizer is not None:
        optimizer.load_state_dict(trainer["optimizer"])
    if restore_rng:
        _set_rng_state(trainer["rng"])
    pending = [PendingGroup(raw["index"], tree_from_json(raw["tree"]), raw["rollout_s"])
               for raw in json.loads((path / "pending.json").read_text())]
    return Checkpoint(path, state, pending)
