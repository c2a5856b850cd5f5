"""Trackers (`learner/trackers.py`): a run's step records go to TensorBoard, W&B (offline)
and MLflow (file store), and each library's own reader gets the same values back, with
the run config and the step's sample sessions. The sessions come from a tree store
written by the gateway's own `TreeStore`."""

import asyncio
import json
from pathlib import Path

import pytest

from undertow.gateway.front.store import TreeStore
from undertow.gateway.trees.tree import Tree
from undertow.learner.config import TrackerConfig
from undertow.learner.metrics_log import read_metrics
from undertow.learner.trackers import SESSION_COLUMNS, TrackedMetricsLog, open_trackers

RUN_CONFIG = {"run": {"run_dir": Path("runs/x")}, "learner": {"lr": 0.001, "group_size": 2},
              "logging": {"trackers": ["tensorboard", "wandb", "mlflow"]}}
STEPS = {1: {"loss": 0.5, "kl": 0.01, "entropy": 2.5, "reward_mean": 0.5, "pass_rate": 0.5,
             "num_sessions": 2, "num_trained_tokens": 40},
         2: {"loss": 0.25, "kl": 0.02, "entropy": 2.25, "reward_mean": 1.0, "pass_rate": 1.0,
             "num_sessions": 2, "num_trained_tokens": 44}}


async def _write_group(store_dir: Path, group: str, rewards: list[float]) -> None:
    store = TreeStore(store_dir)
    await store.start()
    tree = Tree(group)
    for slot, reward in enumerate(rewards):
        session = f"{group}-s{slot}"
        record = tree.add_call(f"{session}-c0", session, [1, 2, 3], [10 + slot, 11, 12],
                               [-0.5, -0.25, -0.125], [0, 0, 0])
        await store.append(group, record.to_json())
        await store.append(group, {"kind": "session_close", "session_id": session,
                                   "reward": reward, "meta": {"cause": "exited"}})
    await store.close()


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    run_dir.mkdir()
    asyncio.run(_write_group(run_dir / "store", "g000000-r0", [1.0, 0.0]))
    asyncio.run(_write_group(run_dir / "store", "g000001-r0", [1.0, 1.0]))
    consumed: list[int] = []
    config = TrackerConfig(trackers=("tensorboard", "wandb", "mlflow"), num_sample_sessions=4)
    trackers = open_trackers(config, run_dir, RUN_CONFIG, lambda: consumed)
    log = TrackedMetricsLog(run_dir, trackers)
    try:
        for step, values in STEPS.items():
            consumed.append(step - 1)   # the learner takes launch index step-1 for the step
            log.append(step, step, values)
    finally:
        trackers.close()
    return run_dir


def test_metrics_jsonl_is_still_written_and_steps_record_their_groups(tracked_run):
    assert [r["loss"] for r in read_metrics(tracked_run)] == [0.5, 0.25]
    lines = [json.loads(line) for line in (tracked_run / "steps.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "indices": [0], "group_ids": ["g000000-r0"]},
                     {"step": 2, "indices": [1], "group_ids": ["g000001-r0"]}]


def test_tensorboard_event_files_hold_the_steps(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tracked_run / "trackers" / "tensorboard"))
    accumulator.Reload()
    for key in ("loss", "kl", "entropy", "reward_mean", "num_trained_tokens"):
        got = [(e.step, e.value) for e in accumulator.Scalars(f"train/{key}")]
        assert got == [(step, pytest.approx(values[key])) for step, values in STEPS.items()]
    config = accumulator.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "lr: 0.001" in config and "run_dir: runs/x" in config
    table = accumulator.Tensors("sessions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "g000000-r0-s0" in table and "g000000-r0-s1" in table


def _wandb_records(run_file: Path) -> list:
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    store = datastore.DataStore()
    store.open_for_scan(str(run_file))
    records = []
    try:
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            records.append(record)
    finally:
        store.close()
    return records


def test_wandb_offline_run_holds_config_history_and_sessions_table(tracked_run):
    (run_file,) = (tracked_run / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["learner"] == {"lr": 0.001, "group_size": 2}
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    losses = {row["_step"]: row["loss"] for row in history if "loss" in row}
    assert losses == {1: 0.5, 2: 0.25}
    tables = [row["sessions/path"] for row in history if "sessions/path" in row]
    assert len(tables) == 2
    table = json.loads((run_file.parent / "files" / tables[0]).read_text())
    assert table["columns"] == list(SESSION_COLUMNS)
    assert [row[2] for row in table["data"]] == ["g000000-r0-s0", "g000000-r0-s1"]
    assert [row[3] for row in table["data"]] == [1.0, 0.0]


def test_mlflow_file_store_holds_metrics_config_and_sessions(tracked_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tracked_run / "trackers" / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("undertow")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.25)]
    assert run.data.params["learner.lr"] == "0.001"
    config_path = client.download_artifacts(run.info.run_id, "config.yaml")
    assert "lr: 0.001" in Path(config_path).read_text()
    sessions = json.loads(Path(client.download_artifacts(
        run.info.run_id, "sessions/step-000002.json")).read_text())
    assert sessions["columns"] == list(SESSION_COLUMNS)
    assert [row[2] for row in sessions["data"]] == ["g000001-r0-s0", "g000001-r0-s1"]


def test_no_trackers_writes_only_the_metrics_and_steps(tmp_path):
    consumed = [0]
    trackers = open_trackers(TrackerConfig(), tmp_path, {}, lambda: consumed)
    log = TrackedMetricsLog(tmp_path, trackers)
    consumed.append(1)
    log.append(1, 1, {"loss": 1.0})
    trackers.close()
    assert not (tmp_path / "trackers").exists()
    assert json.loads((tmp_path / "steps.jsonl").read_text())["indices"] == [1]


def test_unknown_tracker_is_named():
    with pytest.raises(ValueError, match=r"logging.trackers: unknown \['neptune'\]"):
        TrackerConfig(trackers=("tensorboard", "neptune"))


def test_a_group_set_aside_for_damage_is_left_out_of_the_sample_sessions(tmp_path, caplog):
    """A group the gateway set aside (a damaged line in its store file) is consumed and
    dropped by its step: the step's sample sessions name it and hold the others."""
    asyncio.run(_write_group(tmp_path / "store", "g000000-r0", [1.0, 0.0]))
    asyncio.run(_write_group(tmp_path / "store", "g000001-r0", [0.5]))
    damaged = tmp_path / "store" / "g000001-r0.jsonl"
    damaged.write_bytes(b'{"kind": "call", \x00 garbage\n' + damaged.read_bytes())
    trackers = open_trackers(TrackerConfig(trackers=("tensorboard",), num_sample_sessions=4),
                             tmp_path, RUN_CONFIG, list)
    try:
        rows = trackers.session_rows(3, ["g000000-r0", "g000001-r0"])
    finally:
        trackers.close()
    assert [(row[1], row[2], row[3]) for row in rows] == [
        ("g000000-r0", "g000000-r0-s0", 1.0), ("g000000-r0", "g000000-r0-s1", 0.0)]
    assert f"leave group g000001-r0 out: {damaged} line 1 is damaged" in caplog.text
