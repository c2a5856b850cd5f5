"""Checkpoints of a training run, written atomically, and the model directories the engines
load. The run directory's layout and what a resume does with it: docs/training.md,
"Stopping, crashing and resuming".
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from undertow.gateway.trees.template_env import CHAT_TEMPLATE_DIR
from undertow.gateway.trees.tree import tree_from_json, tree_to_json
from undertow.learner.causal_lm import CausalLM
from undertow.learner.errors import LearnerError

CHECKPOINTS = "checkpoints"
WEIGHTS = "weights"
STARTS_FILE = "starts.json"
_NAME = re.compile(r"^step-(\d{6})(?:\.(\d+))?$")
_TMP_NAME = re.compile(r"^\.tmp-.+-(\d+)$")
_LOW_SPACE_BYTES = 1 << 20   # under this free after a failed write: the disk was full
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


class CheckpointError(LearnerError):
    """A checkpoint (or a weights folder) could not be written or read back: the message
    names the file, the cause (`ENOSPC` for a full disk) and what to do."""


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

    def launch(self) -> int:
        """Numbers the next group launched: returns its launch index."""
        self.num_launched += 1
        return self.num_launched - 1


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
    with _quiet_transformers():
        model.save_pretrained(str(out), safe_serialization=True)
    for name in _TOKENIZER_FILES:
        source = Path(base_model_dir) / name
        if source.exists() and not (out / name).exists():
            shutil.copy2(source, out / name)
    named = Path(base_model_dir) / CHAT_TEMPLATE_DIR
    if named.is_dir() and not (out / named.name).exists():
        shutil.copytree(named, out / named.name)
    return out


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars off for the block ("Writing model shards" on every
    step's save), then as they were."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    hub_was_disabled = are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()
        elif not hub_was_disabled:
            enable_progress_bars()


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])


def _atomic_dir(final: Path, fill: Callable[[Path], Any]) -> Path:
    """Creates `final` atomically: `fill(tmp)` writes a hidden directory, every file is
    fsync'ed, then one rename; readers ignore hidden directories, so a crash mid-write
    leaves the previous one the latest. A failure (a full disk) leaves nothing and is a
    `CheckpointError` naming the file and the cause (`ENOSPC`)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        fill(tmp)
        _fsync_tree(tmp)
        os.rename(tmp, final)
        _fsync_tree(final.parent)
    except BaseException as error:
        if not isinstance(error, Exception):
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        cause = error.__cause__ if isinstance(error, _FileWriteError) else error
        name = error.name if isinstance(error, _FileWriteError) else ""
        if isinstance(cause, OSError) and cause.filename:
            name = str(cause.filename)   # the file the system refused, exactly
        why = _cause(cause or error, final.parent)   # before the space is given back
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not write {final}: {why}{f' while writing {name}' if name else ''}; "
            "nothing of it was kept (the previous checkpoint stays the latest). Free space "
            "(or fix the cause) and resume the run with --resume") from error
    return final


class _FileWriteError(LearnerError):
    """A failure of one part of a save, `name` the file it was writing (`_writing`); never
    leaves this module (`_atomic_dir` turns it into a `CheckpointError`)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


@contextlib.contextmanager
def _writing(name: str) -> Iterator[None]:
    try:
        yield
    except Exception as error:
        raise _FileWriteError(name) from error


def _cause(error: BaseException, directory: Path) -> str:
    """What made a write fail, in words: the errno's name when one is known (`ENOSPC`),
    also where the library that wrote reports it only in its message."""
    seen: BaseException | None = error
    while seen is not None:
        code = seen.errno if isinstance(seen, OSError) else None
        if code is not None and code in errno.errorcode:
            return f"{errno.errorcode[code]} ({os.strerror(code)})"
        if "No space left" in str(seen) or "os error 28" in str(seen):
            return f"ENOSPC ({os.strerror(errno.ENOSPC)})"
        seen = seen.__cause__ or seen.__context__
    with contextlib.suppress(OSError):
        usage = shutil.disk_usage(directory)
        if usage.free < _LOW_SPACE_BYTES:
            return (f"ENOSPC ({os.strerror(errno.ENOSPC)}: {usage.free} bytes free on its "
                    f"disk) ({type(error).__name__}: {error})")
    return f"{type(error).__name__}: {error}"


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
    """Writes a checkpoint of `state` atomically; keeps the newest `keep`. Returns it.
    A checkpoint is never overwritten: a second save at a step gets a serial suffix."""
    def fill(tmp: Path) -> None:
        with _writing("model/model.safetensors"):   # save_pretrained: the weights, mostly
            write_model_dir(model, base_model_dir, tmp / "model")
        with _writing("config.yaml"):
            (tmp / "config.yaml").write_text(yaml.safe_dump(resolved_config, sort_keys=True))
        with _writing("trainer.pt"):
            torch.save({"optimizer": optimizer.state_dict(), "rng": _rng_state()},
                       tmp / "trainer.pt")
        with _writing("state.json"):
            (tmp / "state.json").write_text(json.dumps(asdict(state), indent=1))
        with _writing("pending.json"):
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
    """Writes the model directory of weight version `step` (for the engines) atomically;
    keeps it and the newest `keep - 1` of earlier steps (the engines may still read the
    one before). Others, of its step or later, can only be a dead start's: they go."""
    parent = Path(run_dir) / WEIGHTS

    def fill(tmp: Path) -> None:
        with _writing("model.safetensors"):   # save_pretrained: the weights, mostly
            write_model_dir(model, base_model_dir, tmp)

    path = _atomic_dir(_free_name(parent, step), fill)
    others = [p for p in _sorted_dirs(parent) if p != path]
    older = [p for p in others if _step_of(p) < step]
    kept = {path, *older[max(0, len(older) - keep + 1):]}
    for old in others:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)
    return path


def _step_of(path: Path) -> int:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


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
    must be those of a model loaded from `path/model`) and restores the RNG states. A
    file that cannot be read is a `CheckpointError` naming it."""
    path = Path(path)
    with _reading(path / "state.json"):
        state = TrainState(**json.loads((path / "state.json").read_text()))
    with _reading(path / "trainer.pt"):
        trainer = torch.load(path / "trainer.pt", weights_only=True)
    if optimizer is not None:
        with _reading(path / "trainer.pt"):
            optimizer.load_state_dict(trainer["optimizer"])
    if restore_rng:
        _set_rng_state(trainer["rng"])
    with _reading(path / "pending.json"):
        pending = [PendingGroup(raw["index"], tree_from_json(raw["tree"]), raw["rollout_s"])
                   for raw in json.loads((path / "pending.json").read_text())]
    return Checkpoint(path, state, pending)


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    try:
        yield
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {type(error).__name__}: "
                              f"{error}") from error


def check_checkpoint(path: Path) -> None:
    """Raises `CheckpointError` naming the first file of checkpoint `path` that is missing,
    truncated or unreadable: `state.json` and `pending.json` parse, `trainer.pt` is a whole
    zip (its central directory is at the end), each `*.safetensors` of `model/` holds every
    byte its header promises. Cheap: no tensor is read."""
    path = Path(path)
    for name in ("state.json", "pending.json"):
        with _reading(path / name):
            json.loads((path / name).read_text())
    with _reading(path / "trainer.pt"), zipfile.ZipFile(path / "trainer.pt") as archive:
        archive.infolist()
    weights = sorted((path / "model").glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"checkpoint {path} holds no model/*.safetensors file")
    for weight_file in weights:
        with _reading(weight_file):
            _check_safetensors(weight_file)


def _check_safetensors(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        (header_bytes,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_bytes))
    end = max((entry["data_offsets"][1] for name, entry in header.items()
               if name != "__metadata__"), default=0)
    if size != 8 + header_bytes + end:
        raise ValueError(f"truncated: {size} bytes, its header describes {8 + header_bytes + end}")


def restorable_checkpoint(run_dir: Path, report: Callable[[str], None] = print) -> Path | None:
    """The newest whole checkpoint of the run (None if there is none). Each newer damaged
    one is set aside as `checkpoints/.damaged-NAME` (out of the way of later saves, kept
    for a person to look at), and `report` says which file and why."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            check_checkpoint(path)
        except CheckpointError as error:
            aside = path.parent / f".damaged-{path.name}-{os.getpid()}"
            os.rename(path, aside)
            report(f"undertow train: {error}; it is set aside as {aside} and the run resumes "
                   "from the checkpoint before it")
            continue
        return path
    return None


def clear_dead_start(run_dir: Path, step: int) -> None:
    """Removes what a start of the run that died left behind, resuming at `step`: the
    `weights/step-*` folders past it, and the `.tmp-*` folders of processes that are gone."""
    run_dir = Path(run_dir)
    for path in _sorted_dirs(run_dir / WEIGHTS):
        if _step_of(path) > step:
            shutil.rmtree(path, ignore_errors=True)
    for parent in (run_dir / CHECKPOINTS, run_dir / WEIGHTS):
        for path in parent.glob(".tmp-*") if parent.is_dir() else []:
            match = _TMP_NAME.match(path.name)
            if match and not _process_alive(int(match.group(1))):
                shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False   # this process writes none before it has resumed
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def record_start(run_dir: Path, num_resumes: int) -> int:
    """Numbers a start of the run before it launches any group: the larger of `num_resumes`
    (the checkpoint's count plus one) and the number of starts recorded so far, which it
    records, fsync'ed. A start that dies before its first checkpoint thus never gives its
    number, and its groups' names, to the next one."""
    path = Path(run_dir) / STARTS_FILE
    num_starts = 0
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
        num_starts = int(json.loads(path.read_text())["num_starts"])
    number = max(num_resumes, num_starts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{STARTS_FILE}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(json.dumps({"num_starts": number + 1}) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return number
