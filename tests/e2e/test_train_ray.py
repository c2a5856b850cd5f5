"""`undertow train` with `pool.backend: ray` on a Ray cluster of three nodes on this machine
(`ray.cluster_utils.Cluster` in a process of its own, `ray_cluster.py`: a head and two
worker nodes, one CPU each, each declaring one cell's resource so that cell c's members
and engine land on node c).

The run is the one of `test_train_pool.py` (three cells, the elastic policy, the paced
scripted rollouts with one slow session per group, real built-in engines behind the real
gateway), for two steps, its learner members as Ray actors and its engines started by an
actor on their cells' nodes. It must show:
- each member and each engine ran on its cell's node, the members of at least two cells
  on two different nodes, and the gateway answered from every node that hosted an engine;
- each step's parameters equal those of a single-process `Learner` trained on the same
  groups (read back from the gateway's store), within 1e-5;
- both steps were published and the second step's sessions sampled the first step's
  weights, so the weights reached the engines on the other nodes;
- after the run and the cluster's shutdown no process that Ray started is left.
"""

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from tests.processes import alive, descendants
from undertow.learner.checkpoint import latest_checkpoint
from undertow.learner.metrics_log import read_metrics
from undertow.learner.trees import load_store_trees

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                       reason="ray is not installed (pip install -e '.[cluster]')"),
]

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
NUM_CELLS = 3
NUM_TURNS = 2
GROUPS = ("g000000-r0", "g000001-r0")


class ProcessWatch:
    """The processes started below this test process, seen as often as `look` is called."""

    def __init__(self):
        self.before = descendants(os.getpid())
        self.seen: set[int] = set()

    def look(self) -> None:
        self.seen |= descendants(os.getpid()) - self.before

    def left_over(self, grace_s: float = 30.0) -> set[int]:
        """Those still alive after `grace_s`; they are killed, so the suite goes on."""
        deadline = time.monotonic() + grace_s
        while alive(self.seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = alive(self.seen)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left


@dataclass
class RayCluster:
    """The test's cluster: its GCS address and node c's ID at `cell_nodes[c]`."""

    address: str
    cell_nodes: list[str]


@pytest.fixture
def ray_cluster(monkeypatch):
    """Three Ray nodes on 127.0.0.1, node c declaring `cell_resource(c)`, held by their own
    process (`ray_cluster.py`). Yields the cluster and the process watch; at teardown the
    cluster is shut down and no process it started may be left."""
    from undertow.cells.elastic.ray_members import cell_resource

    temp_dir = tempfile.mkdtemp(prefix="ut-ray-")   # short: Ray's socket paths are bounded
    (Path(temp_dir) / "ray").mkdir()    # where Cluster writes the cluster's address
    monkeypatch.setenv("RAY_TMPDIR", temp_dir)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # Read by `undertow train`'s Ray when imported: this machine's address is then
    # 127.0.0.1, where the nodes listen, not the interface's.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    spec = {"temp_dir": temp_dir,
            "nodes": [{"CPU": 1, "resources": {cell_resource(c): 1}} for c in range(NUM_CELLS)]}
    ready = Path(temp_dir) / "ready.json"
    watch = ProcessWatch()
    holder = subprocess.Popen([sys.executable, "-m", "tests.e2e.ray_cluster", json.dumps(spec),
                               str(ready)], cwd=REPO, stdin=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists() and holder.poll() is None and time.monotonic() < deadline:
            watch.look()
            time.sleep(0.5)
        assert ready.exists(), f"the Ray cluster did not start (exit code {holder.poll()})"
        started = json.loads(ready.read_text())
        watch.look()
        yield RayCluster(started["address"], started["node_ids"]), watch
    finally:
        watch.look()
        holder.stdin.close()
        try:
            holder.wait(timeout=TIMEOUT_S / 4)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)
        left = watch.left_over()
    assert holder.returncode == 0, f"the Ray cluster's process exited with {holder.returncode}"
    assert watch.seen, "no Ray process was seen; the check below would be vacuous"
    assert not left, f"processes left after the cluster's shutdown: {left}"


def _train(arguments: list[str], log: Path, watch: ProcessWatch) -> None:
    """Runs `undertow train ARGUMENTS` to its end, watching the processes under this
    test; fails the test with its log if it does not exit 0."""
    command = [sys.executable, "-m", "undertow.cli", "train", *arguments]
    with open(log, "wb") as handle:
        process = subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True,
                                   env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + TIMEOUT_S
    while process.poll() is None and time.monotonic() < deadline:
        watch.look()
        time.sleep(0.5)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"undertow train did not finish; its log:\n{log.read_text()[-3000:]}")
    assert process.returncode == 0, log.read_text()[-3000:]


def _single_process_parameters(run_dir: Path, model_dir: Path, trees, work_dir: Path):
    """The parameters after each step of a one-process `Learner` with the run's
    resolved config, trained on `trees` one group a step."""
    from undertow.config import build_section
    from undertow.learner.config import AdvantageConfig, LossConfig, TrainConfig
    from undertow.learner.train import Learner

    resolved = yaml.safe_load((latest_checkpoint(run_dir) / "config.yaml").read_text())
    learner = Learner(build_section(TrainConfig, resolved["learner"], "learner"),
                      build_section(LossConfig, resolved["loss"], "loss"),
                      build_section(AdvantageConfig, resolved["advantages"], "advantages"),
                      model_dir, work_dir)
    after = []
    for tree in trees:
        learner.train_step([tree])
        after.append({n: p.detach().clone() for n, p in learner.policy.model.named_parameters()})
    return after


def _parameters(model_dir: Path) -> dict[str, torch.Tensor]:
    from undertow.learner.model import PolicyModel

    policy = PolicyModel.load(model_dir, dtype=torch.float32)
    return {n: p.detach() for n, p in policy.model.named_parameters()}


def test_pool_run_on_a_three_node_ray_cluster(ray_cluster, tiny_model_dir, tmp_path):
    from undertow.cells.backends import read_placements

    cluster, watch = ray_cluster
    run_dir = tmp_path / "run"
    _train(["--run-dir", str(run_dir), f"run.model_dir={tiny_model_dir}",
            "learner.num_steps=2", "learner.group_size=4", "learner.lr=0.001",
            # AdamW's first step is lr * g / (|g| + eps): with eps 1e-8, an entry whose
            # gradient is near 1e-8 turns summation-order noise into a visible difference
            # (4e-5 of a 1e-3 step, seen on one machine); with 1e-3 the step follows the
            # gradient itself wherever it is small, which the comparison below then checks.
            "learner.adam_eps=0.001", "learner.checkpoint_every=1",
            "rollout.source=tests.e2e.paced_rollouts:make_run_group",
            f"rollout.scaffold_options={{num_turns: {NUM_TURNS}, max_tokens: 8, "
            "tool_latency_s: [0.0, 0.0, 0.5, 4.0]}",
            "pool.policy=elastic", f"pool.num_cells={NUM_CELLS}", "pool.num_session_slots=2",
            "pool.backend=ray", f"pool.ray_address={cluster.address}",
            "pool.gateway_host=0.0.0.0", "pool.advertise_host=127.0.0.1"],
           tmp_path / "train.log", watch)

    records = read_metrics(run_dir)
    assert [(r["step"], r["weight_version"]) for r in records] == [(1, 1), (2, 2)]
    assert all(r["num_members"] >= 1 and r["num_trained_tokens"] > 0 for r in records)

    # Where things ran: each on its cell's node; members of two cells on two nodes.
    placements = read_placements(run_dir)
    members = [p for p in placements if p["kind"] == "member"]
    engines = [p for p in placements if p["kind"] == "engine"]
    assert members and all("error" not in p for p in members), placements
    assert all(p["node_id"] == cluster.cell_nodes[p["cell_id"]] for p in members + engines)
    assert len({p["node_id"] for p in members}) >= 2, members
    assert sorted(p["cell_id"] for p in engines) == list(range(NUM_CELLS))
    assert all(p["gateway_reachable"] is True for p in engines)
    assert not {p["pid"] for p in members} & {p["pid"] for p in engines}

    # The weights reached the engines: step 2's sessions sampled version 1.
    trees = {tree.group_id: tree for tree in load_store_trees(run_dir / "store")}
    assert sorted(trees) == list(GROUPS)
    for version, group_id in enumerate(GROUPS):
        tree = trees[group_id]
        assert len(tree.sessions) == 4 and all(p.closed for p in tree.sessions.values())
        assert {v for n in tree.nodes.values() if n.trainable
                for v in n.weight_versions} == {version}

    # The exact gradient: the same parameters as one process training the same groups.
    expected = _single_process_parameters(run_dir, tiny_model_dir,
                                          [trees[g] for g in GROUPS], tmp_path / "reference")
    for step, want in enumerate(expected, start=1):
        got = _parameters(run_dir / "checkpoints" / f"step-{step:06d}" / "model")
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0,
                                       msg=f"step {step}: {name}")
    initial = _parameters(tiny_model_dir)
    moved = max((expected[0][n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 1e-4, "the first step did not move the parameters; the check is vacuous"
