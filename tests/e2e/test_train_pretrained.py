"""`undertow train` and `undertow sft` on a pretrained model: SmolLM2-135M-Instruct (Llama,
its own tokenizer and chat template), from its directory (`configs/learn-smollm2.yaml`: no
tiny model, no warm start), served by the built-in engine from the same directory.

Two RL steps with the scripted rollouts (`scripted_rollouts.py`: the real `openai` client
through the real gateway and engine, rewards by slot): each step's weights reach the
engine (its weight version advances and the second group was sampled by version 1), and
what the engine computes changes with them: the logprobs it recorded for the second
group's tokens are the step-1 weights' (as the learner scores them), far from the base
model's. Then `undertow sft` on the sessions that run stored: the loss on them falls.
"""

import shutil
from pathlib import Path

import pytest
import torch

from tests.processes import run_train, run_undertow
from undertow.learner.checkpoint import WEIGHTS, list_checkpoints
from undertow.learner.metrics_log import read_metrics
from undertow.learner.model import PolicyModel
from undertow.learner.reference import flat_samples
from undertow.learner.trees import load_store_trees

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "undertow" / "configs" / "learn-smollm2.yaml"
TIMEOUT_S = 1200   # at load 20-27 on this 2-core machine: train 7.7 min, sft 8.8 min


@pytest.fixture(scope="module")
def smollm2_run(smollm2_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("train-smollm2") / "run"
    log = run_dir.parent / "train.log"
    code = run_train(run_dir, ["-c", str(CONFIG), f"run.model_dir={smollm2_dir}",
                               "learner.num_steps=2", "learner.group_size=2",
                               "learner.lr=0.0001", "learner.checkpoint_every=2",
                               "rollout.source=tests.e2e.scripted_rollouts:make_run_group"],
                     log, TIMEOUT_S)
    assert code == 0, log.read_text()[-3000:]
    yield run_dir
    shutil.rmtree(run_dir.parent)  # a checkpoint and pushed weights, 2 GB: fit a small disk


def test_two_steps_from_the_model_directory_reach_the_engine(smollm2_run):
    records = read_metrics(smollm2_run)
    assert [(r["step"], r["weight_version"]) for r in records] == [(1, 1), (2, 2)]
    assert all(r["num_sessions"] == 2 and r["num_trained_tokens"] > 0 for r in records)
    assert all(r["grad_norm"] > 0 for r in records)
    log = (smollm2_run.parent / "train.log").read_text()
    assert "warm start" not in log and not (smollm2_run / "model-base").exists()
    trees = {tree.group_id: tree for tree in load_store_trees(smollm2_run / "store")}
    versions = {group: {v for n in tree.nodes.values() if n.trainable for v in n.weight_versions}
                for group, tree in trees.items()}
    assert versions == {"g000000-r0": {0}, "g000001-r0": {1}}
    for record in records:   # the engine sampled with the weights the learner scores with
        assert record["mismatch_max"] < 1e-3, record


def test_the_engine_computes_with_the_pushed_weights(smollm2_run, smollm2_dir):
    """The second group's tokens as the engine recorded them (behaviour logprobs), the
    step-1 weights' and the base model's: the engine's are the step-1 weights'."""
    (tree,) = [t for t in load_store_trees(smollm2_run / "store") if t.group_id.startswith(
        "g000001")]
    samples = flat_samples([tree], {(tree.group_id, s): 1.0 for s in tree.sessions})
    engine = torch.cat([sample.behaviour for sample in samples])

    def logprobs(model_dir: Path) -> torch.Tensor:
        policy = PolicyModel.load(model_dir)
        with torch.no_grad():
            return torch.cat([policy.score_path(s.token_ids, s.scored).logprobs.double()
                              for s in samples])

    # Step 1's weights as pushed to the engine (only step 2 is a checkpoint: 1.6 GB less)
    step_1 = smollm2_run / WEIGHTS / "step-000001"
    assert [path.name for path in list_checkpoints(smollm2_run)] == ["step-000002"]
    trained, base = logprobs(step_1), logprobs(smollm2_dir)
    assert (engine - trained).abs().max() < 1e-3
    assert (engine - base).abs().max() > 100 * (engine - trained).abs().max()


def test_sft_on_the_stored_sessions_lowers_their_loss(smollm2_run, smollm2_dir, tmp_path):
    out, log = tmp_path / "sft", tmp_path / "sft.log"
    code = run_undertow(["sft", "--store", str(smollm2_run / "store"), "--model",
                         str(smollm2_dir), "--out", str(out), "sft.num_epochs=3",
                         "sft.groups_per_step=2", "sft.lr=0.0001"], log, TIMEOUT_S)
    assert code == 0, log.read_text()[-3000:]
    losses = [record["loss"] for record in read_metrics(out)]
    assert len(losses) == 3
    assert losses[2] < 0.8 * losses[0], losses
    assert (out / "chat_template.jinja").read_text() == (
        smollm2_dir / "chat_template.jinja").read_text()
