"""Experiment trackers: the per-step metrics of `metrics.jsonl`, also sent where people look
(TensorBoard, W&B, MLflow: `logging.trackers`, none by default), with the resolved run config
and a table of each step's sessions; and `RUN/steps.jsonl`, the groups each step took. What
a user sets and reads: docs/ui.md. Each library is imported only when its tracker opens (the
`trackers` extra installs them).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from undertow.learner.config import TrackerConfig
from undertow.learner.metrics_log import MetricsLog
from undertow.learner.trees import StoreFileDamaged, load_store_tree

log = logging.getLogger(__name__)

STEPS_FILE = "steps.jsonl"
GROUP_NAME = re.compile(r"^g(\d{6})-r(\d+)(?:\..+)?$")
SESSION_COLUMNS = ("step", "group", "session", "reward", "cause", "num_calls",
                   "num_completion_tokens", "last_reply")
MAX_REPLY_CHARS = 400


class Tracker(Protocol):
    """One tracker of one run; opened with the run config."""

    def log_step(self, step: int, values: dict[str, float]) -> None: ...

    def log_sessions(self, step: int, rows: list[list[Any]]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars under `train/<key>`; the config and session tables as text summaries."""

    def __init__(self, directory: Path, run_config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))
        self.writer.add_text("config", _code_block(yaml.safe_dump(run_config, sort_keys=True)), 0)

    def log_step(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"train/{key}", value, step)
        self.writer.flush()

    def log_sessions(self, step: int, rows: list[list[Any]]) -> None:
        self.writer.add_text("sessions", _markdown_table(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run (offline by default) with the run config as its config; sessions as a
    `wandb.Table` logged at the step's history row."""

    def __init__(self, directory: Path, run_config: dict[str, Any], config: TrackerConfig,
                 run_name: str):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True)
        self.run = wandb.init(project=config.project, name=run_name, dir=str(directory),
                              mode=config.wandb_mode,  # pyright: ignore[reportArgumentType]  # one of WANDB_MODES: TrackerConfig checked it
                              config=run_config, settings=settings)

    def log_step(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_sessions(self, step: int, rows: list[list[Any]]) -> None:
        table = self.wandb.Table(columns=list(SESSION_COLUMNS), data=[*rows])  # list[InputRow]
        self.run.log({"sessions": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in a local file store: metrics per step, the config as `config.yaml`
    and flattened params, sessions as `sessions/step-NNNNNN.json` (MLflow's table form,
    columns and data)."""

    def __init__(self, directory: Path, run_config: dict[str, Any], config: TrackerConfig,
                 run_name: str):
        # MLflow 3 keeps the file store behind this opt-in (it prefers a database); the
        # file store is what a user can read, copy and serve with `mlflow ui` as is.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.metric_type = Metric
        self.client = MlflowClient(tracking_uri=directory.resolve().as_uri())
        experiment = self.client.get_experiment_by_name(config.project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(config.project))
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.client.log_dict(self.run_id, run_config, "config.yaml")
        params = [Param(key, str(value)[:6000]) for key, value in _flatten(run_config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log_step(self, step: int, values: dict[str, float]) -> None:
        timestamp_ms = _now_ms()
        metrics = [self.metric_type(key, float(value), timestamp_ms, step)
                   for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_sessions(self, step: int, rows: list[list[Any]]) -> None:
        self.client.log_dict(self.run_id, {"columns": list(SESSION_COLUMNS), "data": rows},
                             f"sessions/step-{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """The trackers of one run, fed one metrics record per step (`on_step`).

    It also appends the groups each step took to `RUN/steps.jsonl` (the run viewer's
    step page reads it): the launch indices `consumed()` gained since the last step
    (trained, or dropped by the step), named as their newest group file in the store.
    Numeric fields go to every tracker; those groups' sessions make the step's table."""

    def __init__(self, trackers: Sequence[Tracker] = (), run_dir: Path | None = None,
                 store_dir: Path | None = None, consumed: Callable[[], list[int]] | None = None,
                 num_sample_sessions: int = 0, model_dir: Path | None = None):
        self.trackers = list(trackers)
        self.run_dir = Path(run_dir) if run_dir else None
        self.store_dir = Path(store_dir) if store_dir else None
        self.consumed = consumed or list
        self.num_seen = len(self.consumed())
        self.num_sample_sessions = num_sample_sessions
        self.model_dir = model_dir
        self._tokenizer = None

    def on_step(self, record: dict[str, Any]) -> None:
        step = record["step"]
        group_ids = self._record_step_groups(step)
        values: dict[str, float] = {key: value for key, value in record.items()
                  if key != "step" and isinstance(value, int | float)
                  and not isinstance(value, bool)}
        for tracker in self.trackers:
            tracker.log_step(step, values)
        rows = self.session_rows(step, group_ids) if self.trackers else []
        if rows:
            for tracker in self.trackers:
                tracker.log_sessions(step, rows)

    def _record_step_groups(self, step: int) -> list[str]:
        consumed = list(self.consumed())
        indices, self.num_seen = consumed[self.num_seen:], len(consumed)
        group_ids = [g for g in (self._group_of(i) for i in indices) if g]
        if self.run_dir is not None:
            line = json.dumps({"step": step, "indices": indices, "group_ids": group_ids})
            with open(self.run_dir / STEPS_FILE, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")
        return group_ids

    def _group_of(self, index: int) -> str | None:
        return newest_groups(self.store_dir).get(index) if self.store_dir else None

    def session_rows(self, step: int, group_ids: list[str]) -> list[list[Any]]:
        """Up to `num_sample_sessions` rows (`SESSION_COLUMNS`) of the step's groups."""
        rows: list[list[Any]] = []
        for group_id in group_ids:
            path = self.store_dir / f"{group_id}.jsonl" if self.store_dir else None
            if path is None or not path.exists():
                continue
            try:
                tree = load_store_tree(path)
            except StoreFileDamaged as damage:   # set aside by the gateway; dropped
                log.warning("step %d's sample sessions leave group %s out: %s", step,
                            group_id, damage)
                continue
            for session_id, paths in sorted(tree.sessions.items()):
                if len(rows) >= self.num_sample_sessions:
                    return rows
                calls = [call for call in tree.calls if call.session_id == session_id]
                rows.append([step, group_id, session_id, paths.reward,
                             str(paths.meta.get("cause", "")), len(calls),
                             sum(call.num_completion_tokens for call in calls),
                             self._last_reply(tree, calls)])
        return rows

    def _last_reply(self, tree, calls) -> str:
        if not calls:
            return ""
        node = tree.nodes[calls[-1].leaf]
        token_ids = node.token_ids[-calls[-1].num_completion_tokens:] if node.trainable else []
        tokenizer = self._load_tokenizer()
        text = (tokenizer.decode(token_ids) if tokenizer is not None
                else " ".join(map(str, token_ids)))
        return text[:MAX_REPLY_CHARS]

    def _load_tokenizer(self):
        if self._tokenizer is None and self.model_dir is not None:
            path = Path(self.model_dir) / "tokenizer.json"
            if path.exists():
                from tokenizers import Tokenizer

                self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


class TrackedMetricsLog(MetricsLog):
    """`MetricsLog` that hands each record it writes to `Trackers.on_step`."""

    def __init__(self, run_dir: Path, trackers: Trackers):
        super().__init__(run_dir)
        self.trackers = trackers

    def append(self, step: int, weight_version: int, values: dict[str, Any]) -> dict[str, Any]:
        record = super().append(step, weight_version, values)
        self.trackers.on_step(record)
        return record


def open_trackers(config: TrackerConfig, run_dir: Path, run_config: dict[str, Any],
                  consumed: Callable[[], list[int]] | None = None,
                  store_dir: Path | None = None, model_dir: Path | None = None) -> Trackers:
    """Opens the trackers `config` names for the run in `run_dir` (store: `RUN/store`)."""
    run_dir = Path(run_dir)
    directory = Path(config.dir) if config.dir else run_dir / "trackers"
    run_name = config.run_name or run_dir.resolve().name
    run_config = json.loads(json.dumps(run_config, default=str))  # paths as strings
    opened: list[Tracker] = []
    for name in config.trackers:
        if name == "tensorboard":
            opened.append(TensorBoardTracker(directory / "tensorboard", run_config))
        elif name == "wandb":
            opened.append(WandbTracker(directory, run_config, config, run_name))
        else:
            opened.append(MlflowTracker(directory / "mlruns", run_config, config, run_name))
    return Trackers(opened, run_dir, store_dir or run_dir / "store", consumed,
                    config.num_sample_sessions, model_dir)


def truncate_steps(run_dir: Path, step: int) -> None:
    """Drops the lines of `RUN/steps.jsonl` past `step` (and any torn line), atomically."""
    path = Path(run_dir) / STEPS_FILE
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) \
                and record["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def newest_groups(store_dir: Path) -> dict[int, str]:
    """Launch index -> the newest group of the store that ran it: `g000003-r1` after one
    resume (the rollout runner may add `.INSTANCE_ID`: `g000003-r1.calclang__calclang-2`)."""
    newest: dict[int, tuple[int, str]] = {}
    for path in Path(store_dir).glob("g*.jsonl"):
        match = GROUP_NAME.match(path.stem)
        if match:
            index, resume = int(match.group(1)), int(match.group(2))
            if index not in newest or resume > newest[index][0]:
                newest[index] = (resume, path.stem)
    return {index: name for index, (_, name) in newest.items()}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _code_block(text: str) -> str:
    return "".join(f"    {line}\n" for line in text.splitlines())


def _markdown_table(rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(SESSION_COLUMNS) + " |",
             "|" + "---|" * len(SESSION_COLUMNS)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)
