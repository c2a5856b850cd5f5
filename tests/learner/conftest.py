"""Fixtures for the learner's math tests: random group trees (`random_trees.py`) and
the tiny model at float32, with a nearby reference model."""

import copy

import pytest
import torch

from tests.learner.random_trees import build_random_tree


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: on this shared 2-core machine, two threads contend and the
    tiny model's forward gets tens of times slower; results do not depend on it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def random_trees() -> list:
    """Two groups of three sessions each, with branches."""
    return [build_random_tree(1, "g1"), build_random_tree(2, "g2", num_turns=5)]


@pytest.fixture(scope="session")
def tiny_untied_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model's tokenizer and shape with an LM head of its own (`tiny-untied`),
    its weights drawn by `write_weights`; without training the tokenizer again."""
    import json
    import shutil

    from undertow.learner.modeldir.weights import write_weights

    out = tmp_path_factory.mktemp("models") / "tiny-untied"
    shutil.copytree(tiny_model_dir, out)
    (out / "model.safetensors").unlink()
    config = json.loads((out / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_weights(out, seed=1)
    return out


@pytest.fixture(scope="session")
def policy32(tiny_model_dir):
    from undertow.learner.model import PolicyModel

    policy = PolicyModel.load(tiny_model_dir, dtype=torch.float32)
    policy.max_query_tokens = 8   # block attention with many query chunks
    return policy


@pytest.fixture(scope="session")
def reference32(policy32):
    """A reference model near the policy: its weights plus small deterministic noise."""
    from undertow.learner.model import PolicyModel

    model = copy.deepcopy(policy32.model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(0.01 * noise)
    return PolicyModel(model, max_query_tokens=8)
