"""Run directories as the viewer reads them: what each holds (docs/commands.md, "A run
directory") and what it lacks.

Any file may be missing or half-written (a run that crashed, or is still going):
`RunFolder.problems` says what is not there, every reader returns what is, and a line of
a record file that is not a record is named with its file and line (`read_jsonl`) and
skipped. `Catalog` is the set of runs `undertow ui --runs DIR` serves. Nothing here
imports torch or writes a file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import yaml

from undertow.errors import CommandError
from undertow.gateway.trees.tree import Tree
from undertow.learner.metrics_log import METRICS_FILE
from undertow.learner.trackers import STEPS_FILE, newest_groups
from undertow.learner.trees import load_store_tree

CHECKPOINT_NAME = re.compile(r"^step-(\d{6})(?:\.(\d+))?$")
RUN_MARKERS = (METRICS_FILE, "checkpoints", "store")
STORE_RUN = "store"
# Written by every run (`undertow/cells/loop.py`): every decision and step with the cells' roles.
POOL_TIMELINE_FILE = "pool_timeline.jsonl"
# Bad lines listed per file; a run whose every line is damaged names a few, then counts.
MAX_LINE_PROBLEMS = 5


class NotFoundError(CommandError, LookupError):
    """A run, step, group or session the viewer was asked for does not exist."""


def read_jsonl(path: Path, name: str,
               check: Callable[[dict[str, Any]], str] | None = None,
               ) -> tuple[list[dict[str, Any]], list[str]]:
    """The records (JSON objects) of a JSON-lines file, and each line that is not one,
    in words naming `name` and the line: a last line cut off (the file ends mid-line:
    a run that stopped while writing, or one still writing), a damaged line (not JSON),
    a record of the wrong type (JSON, not an object), or one that `check` refuses (it
    returns why, or "" for a good record). Bad lines are skipped, the rest is kept;
    at most `MAX_LINE_PROBLEMS` are listed per file, then how many more there are."""
    if not path.exists():
        return [], []
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as error:
        return [], [f"{name} cannot be read ({error}); none of its records are shown"]
    records, problems = [], []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        problem = ""
        try:
            record = json.loads(line)
        except ValueError as error:  # not JSON, or not UTF-8 text
            problem = ("is cut off (the file ends mid-line: written while the run stopped, "
                       "or still being written)" if index == len(lines) - 1
                       else f"is damaged ({_not_json(error)})")
        else:
            if not isinstance(record, dict):
                problem = f"holds {_json_kind(record)}, not a record (a JSON object)"
            elif check is not None and (why := check(record)):
                problem = why
            else:
                records.append(record)
        if problem:
            problems.append(f"{name} line {index + 1} {problem}; it is skipped")
    if len(problems) > MAX_LINE_PROBLEMS:
        num_more = len(problems) - MAX_LINE_PROBLEMS
        problems = problems[:MAX_LINE_PROBLEMS] + [f"{name}: {num_more} more bad lines"]
    return records, problems


def _not_json(error: ValueError) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"not JSON: {error.msg.removesuffix(' at')} at column {error.colno}"
    return "not UTF-8 text"


def _json_kind(value: object) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    kinds = {list: "a list", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def _step_record_problem(record: dict[str, Any]) -> str:
    """Why a metrics record cannot be a step ("" when it can): it needs an integer step."""
    step = record.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return ""
    return f'has no step number ("step" is {json.dumps(step)[:40]}, not an integer)'


@dataclass
class _CachedTree:
    key: tuple[int, int]
    tree: Tree


class Decoder:
    """Token IDs to text with the run's tokenizer (`tokenizer.json`), or to `<ID>`."""

    def __init__(self, model_dir: Path | None):
        self.tokenizer = None
        if model_dir is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

    def text(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(f"<{t}>" for t in token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def pieces(self, token_ids: list[int]) -> list[str]:
        if self.tokenizer is None:
            return [f"<{t}>" for t in token_ids]
        return self.tokenizer.decode_batch([[t] for t in token_ids], skip_special_tokens=False)


class RunFolder:
    """One run directory (or, with `store_only`, a bare tree store)."""

    def __init__(self, name: str, path: Path, store_dir: Path | None = None):
        self.name, self.path = name, Path(path)
        self.store_dir = Path(store_dir) if store_dir else self.path / "store"
        self.store_only = store_dir is not None and not (self.path / METRICS_FILE).exists()
        self._trees: dict[str, _CachedTree] = {}
        self._decoder: tuple[Path | None, Decoder] | None = None

    def checkpoints(self) -> list[Path]:
        folder = self.path / "checkpoints"
        if not folder.is_dir():
            return []
        found = [(tuple(int(g or 0) for g in match.groups()), p) for p in folder.iterdir()
                 if p.is_dir() and (match := CHECKPOINT_NAME.match(p.name))]
        return [p for _, p in sorted(found)]

    def config(self) -> dict[str, Any]:
        """The resolved run config of the latest checkpoint that has a readable one."""
        for checkpoint in reversed(self.checkpoints()):
            try:
                loaded = yaml.safe_load((checkpoint / "config.yaml").read_text())
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(loaded, dict):
                return loaded
        return {}

    def metrics(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The step records of `metrics.jsonl`, one per step, and its lines that are not
        one (in words). Fields this version does not know are kept as they are. A step
        written twice (a log from before resumes cut it back) is the last line's."""
        lines, problems = read_jsonl(self.path / METRICS_FILE, METRICS_FILE,
                                     _step_record_problem)
        records = list({record["step"]: record for record in lines}.values())
        for record in records:
            step_s, num_tokens = record.get("step_s"), record.get("num_trained_tokens")
            if _is_number(step_s) and step_s > 0 and _is_number(num_tokens):
                record["tokens_per_s"] = num_tokens / step_s
        return records, problems

    def line_problems(self) -> list[str]:
        """The bad lines of the run's other record files (`steps.jsonl`, the pool timeline)."""
        return [problem for name in (STEPS_FILE, POOL_TIMELINE_FILE)
                for problem in read_jsonl(self.path / name, name)[1]]

    def cell_timeline(self) -> list[dict[str, Any]]:
        """A pool run's events that carry the cells' roles (`t_s`, `event`, `cells`,
        `step`), in order; empty for a run without a pool."""
        records, _ = read_jsonl(self.path / POOL_TIMELINE_FILE, POOL_TIMELINE_FILE)
        return [{k: r.get(k) for k in ("t_s", "event", "step", "weight_version", "cells")}
                for r in records if isinstance(r.get("cells"), dict)]

    def groups(self) -> list[str]:
        if not self.store_dir.is_dir():
            return []
        return sorted(p.stem for p in self.store_dir.glob("*.jsonl"))

    def tree(self, group: str) -> Tree:
        """The group's tree, replayed from the store (cached while the file is unchanged)."""
        path = self.store_dir / f"{group}.jsonl"
        if group not in self.groups():
            raise NotFoundError(f"run {self.name} has no group {group!r} in {self.store_dir}")
        stat = path.stat()
        key = (stat.st_mtime_ns, stat.st_size)
        cached = self._trees.get(group)
        if cached is None or cached.key != key:
            cached = _CachedTree(key, load_store_tree(path))
            self._trees[group] = cached
        return cached.tree

    def step_groups(self, step: int) -> tuple[list[str], str]:
        """The groups step `step` took (trained, or dropped by it), and where that came
        from: `steps.jsonl` (launch indices, named by the store), or an inference from
        launch order when the run did not record them."""
        records, _ = read_jsonl(self.path / STEPS_FILE, STEPS_FILE)
        # After a resume the step is taken again: its last line is the one trained.
        matching = [r for r in records if r.get("step") == step]
        newest = newest_groups(self.store_dir) if self.store_dir.is_dir() else {}
        if matching:
            record = matching[-1]
            recorded = [str(g) for g in record.get("group_ids") or []]
            if recorded and all((self.store_dir / f"{g}.jsonl").exists() for g in recorded):
                return recorded, "recorded"   # as trained (a later start may re-run one)
            named = [newest[i] for i in record.get("indices", []) if i in newest]
            return named or recorded, "recorded"
        per_step = int((self.config().get("learner") or {}).get("groups_per_step", 1) or 1)
        return [newest[i] for i in sorted(newest) if i // per_step + 1 == step], "inferred"

    def scaffold_messages(self, group: str, session_id: str) -> list[dict[str, Any]]:
        """The messages the scaffold kept, when its rollout saved a trajectory
        (`rollouts/GROUP/sessions/SESSION/trajectory.json`, mini-swe-agent's), else []."""
        path = self.path / "rollouts" / group / "sessions" / session_id / "trajectory.json"
        try:
            messages = json.loads(path.read_text()).get("messages") or []
        except (OSError, ValueError, AttributeError):
            return []
        return [{"role": str(m.get("role", "")), "content": _text(m.get("content"))}
                for m in messages if isinstance(m, dict)]

    def decoder(self) -> Decoder:
        """The run's `Decoder`, loaded once per tokenizer directory."""
        model_dir = self.tokenizer_dir()
        if self._decoder is None or self._decoder[0] != model_dir:
            self._decoder = (model_dir, Decoder(model_dir))
        return self._decoder[1]

    def tokenizer_dir(self) -> Path | None:
        """A model directory holding the run's tokenizer: a checkpoint's, the base."""
        candidates = [c / "model" for c in reversed(self.checkpoints())]
        model_dir = (self.config().get("run") or {}).get("model_dir")
        candidates += [Path(model_dir)] if model_dir else []
        candidates += [self.path / "model-base"]
        return next((c for c in candidates if (c / "tokenizer.json").exists()), None)

    def status(self, num_records: int) -> str:
        num_steps = (self.config().get("learner") or {}).get("num_steps")
        if self.store_only:
            return "store"
        if not num_records:
            return "no step yet"
        if num_steps and num_records >= num_steps:
            return "done"
        return f"step {num_records} of {num_steps or '?'}"

    def problems(self) -> list[str]:
        """What the run lacks, in words (empty for a complete run); the bad lines of its
        record files are `metrics()`'s and `line_problems()`'s."""
        found = []
        if not self.path.is_dir():
            return [f"{self.path} does not exist"]
        if not self.store_only and not (self.path / METRICS_FILE).exists():
            found.append(f"no {METRICS_FILE}: no step has finished (or this is not a run)")
        if not self.store_only and not self.checkpoints():
            found.append("no checkpoint: the run config and state are unknown")
        if not self.store_dir.is_dir():
            found.append(f"no tree store at {self.store_dir}: sessions cannot be shown")
        elif not self.groups():
            found.append(f"the tree store {self.store_dir} holds no group yet")
        return found

    def summary(self) -> dict[str, Any]:
        records, bad_lines = self.metrics()
        return {"name": self.name, "path": str(self.path), "status": self.status(len(records)),
                "num_steps": len(records), "num_groups": len(self.groups()),
                "problems": self.problems() + bad_lines + self.line_problems()}


class Catalog:
    """The runs `undertow ui` serves, by name."""

    def __init__(self, runs_dir: Path, store_dir: Path | None = None):
        self.runs_dir = Path(runs_dir)
        self.runs: dict[str, RunFolder] = {}
        self.store_dir = Path(store_dir) if store_dir else None
        self.refresh()

    def refresh(self) -> None:
        found = {}
        if _is_run(self.runs_dir):
            found[self.runs_dir.resolve().name] = self.runs_dir
        elif self.runs_dir.is_dir():
            found = {p.name: p for p in sorted(self.runs_dir.iterdir())
                     if p.is_dir() and not p.name.startswith(".") and _is_run(p)}
        for name, path in found.items():
            if name not in self.runs:
                self.runs[name] = RunFolder(name, path)
        for name in set(self.runs) - set(found) - {STORE_RUN}:
            del self.runs[name]
        if self.store_dir is not None and STORE_RUN not in self.runs:
            self.runs[STORE_RUN] = RunFolder(STORE_RUN, self.store_dir, self.store_dir)

    def run(self, name: str) -> RunFolder:
        self.refresh()
        if name not in self.runs:
            raise NotFoundError(f"no run {name!r} under {self.runs_dir}; "
                                f"known: {sorted(self.runs)}")
        return self.runs[name]

    def problems(self) -> list[str]:
        if not self.runs_dir.exists():
            return [f"{self.runs_dir} does not exist"]
        if not self.runs:
            return [f"{self.runs_dir} holds no run (a folder with {METRICS_FILE}, "
                    "checkpoints/ or store/)"]
        return []


def _text(content: object, max_chars: int = 20_000) -> str:
    """A message's content as text (OpenAI content parts joined), cut at `max_chars`."""
    if isinstance(content, list):
        content = "\n".join(str(part.get("text", part)) if isinstance(part, dict) else str(part)
                            for part in content)
    text = "" if content is None else str(content)
    return text if len(text) <= max_chars else text[:max_chars] + f" … ({len(text)} chars)"


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_run(path: Path) -> bool:
    return path.is_dir() and any((path / marker).exists() for marker in RUN_MARKERS)
