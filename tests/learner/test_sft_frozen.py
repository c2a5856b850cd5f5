"""`sft.frozen`: an SFT start keeps the parameters RL will not train (the embedding and
untied head of a pretrained policy) at their start values, and trains the rest."""

import pytest
import torch

from undertow.learner.config import SFTConfig
from undertow.learner.model import PolicyModel
from undertow.learner.sft import run_sft

from .conftest import build_random_tree

pytestmark = pytest.mark.slow


def test_frozen_parameters_keep_their_start_values_and_the_rest_train(
        tiny_untied_model_dir, tmp_path):
    trees = [build_random_tree(5, "g5")]
    frozen = ("model.embed_tokens", "lm_head")
    config = SFTConfig(num_epochs=1, lr=1e-3, frozen=frozen)
    out = run_sft(trees, tiny_untied_model_dir, tmp_path / "sft", config)
    before = dict(PolicyModel.load(tiny_untied_model_dir).model.named_parameters())
    after = dict(PolicyModel.load(out).model.named_parameters())
    changed = {name for name, value in after.items()
               if not torch.equal(value, before[name])}
    assert before.keys() == after.keys() and changed
    assert not {name for name in changed if name.startswith(frozen)}
    assert {name.split(".")[0] for name in before if name not in changed} >= {"lm_head"}
    with pytest.raises(ValueError, match="names no parameter"):
        run_sft(trees, tiny_untied_model_dir, tmp_path / "bad",
                SFTConfig(frozen=("model.no_such_layer",)))
