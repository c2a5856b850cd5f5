"""Fixtures for the learner's math tests: random group trees (`random_trees.py`), the
tiny model at float32 with a nearby reference model, and small random models of the
pretrained families' architectures (Llama from SmolLM2's config, Qwen2 from
Qwen2.5-Coder's)."""

import copy
from pathlib import Path

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


def _shrunk_model_dir(real_dir: Path, out: Path, seed: int) -> Path:
    """A model of `real_dir`'s architecture and config (its family, biases, norms, rope,
    tied head) shrunk to 2 layers of width 64 with random weights from `seed`: the
    family's code path in milliseconds. Vocabulary 6016 (the random trees' IDs < 6000)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(real_dir)
    config.update({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "vocab_size": 6016, "tie_word_embeddings": True,
                   "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:2]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_model_dir(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2's Llama config shrunk (`_shrunk_model_dir`)."""
    return _shrunk_model_dir(smollm2_dir, tmp_path_factory.mktemp("models") / "llama", 1)


@pytest.fixture(scope="session")
def tiny_qwen2_model_dir(qwen_coder_dir, tmp_path_factory) -> Path:
    """Qwen2.5-Coder's Qwen2 config (q/k/v biases) shrunk (`_shrunk_model_dir`)."""
    return _shrunk_model_dir(qwen_coder_dir, tmp_path_factory.mktemp("models") / "qwen2", 2)
