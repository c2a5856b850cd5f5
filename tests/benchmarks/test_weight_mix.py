"""benchmarks/weight_mix.py: base + alpha * (tuned - base) per tensor, in the tuned
model's dtype, with the tuned directory's other files beside it; models that differ in
a tensor's name or shape are refused."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.weight_mix import main, mix


def _model(path, tensors, config=None):
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config or {"model_type": "qwen2"}))
    return path


def test_each_tensor_is_the_linear_mix_in_the_tuned_dtype(tmp_path):
    base = _model(tmp_path / "base", {"w": torch.tensor([0.0, 2.0, -4.0]),
                                      "b": torch.tensor([[1.0]])})
    tuned = _model(tmp_path / "tuned", {"w": torch.tensor([4.0, 2.0, 4.0]).bfloat16(),
                                        "b": torch.tensor([[3.0]]).bfloat16()},
                   {"model_type": "qwen2", "tuned": True})
    (tuned / "metrics.jsonl").write_text("{}\n")
    main(["--base", str(base), "--tuned", str(tuned), "--alpha", "0.25",
          "--out", str(tmp_path / "mixed")])
    mixed = load_file(tmp_path / "mixed" / "model.safetensors")
    assert mixed["w"].dtype == torch.bfloat16
    assert mixed["w"].float().tolist() == [1.0, 2.0, -2.0]   # 0.75 * base + 0.25 * tuned
    assert mixed["b"].float().tolist() == [[1.5]]
    assert json.loads((tmp_path / "mixed" / "config.json").read_text())["tuned"]
    assert not (tmp_path / "mixed" / "metrics.jsonl").exists()


def test_the_ends_are_the_two_models(tmp_path):
    base = _model(tmp_path / "base", {"w": torch.tensor([0.5, -1.0])})
    tuned = _model(tmp_path / "tuned", {"w": torch.tensor([2.0, 3.0])})
    for alpha, expected in ((0.0, base), (1.0, tuned)):
        out = mix(base, tuned, alpha, tmp_path / f"mixed-{alpha}")
        assert torch.equal(load_file(out / "model.safetensors")["w"],
                           load_file(expected / "model.safetensors")["w"])


@pytest.mark.parametrize("tuned_tensors, message", [
    ({"w": torch.zeros(2), "extra": torch.zeros(1)}, "different tensors"),
    ({"w": torch.zeros(3)}, "shape"),
])
def test_models_that_differ_are_refused(tmp_path, tuned_tensors, message):
    base = _model(tmp_path / "base", {"w": torch.zeros(2)})
    tuned = _model(tmp_path / "tuned", tuned_tensors)
    with pytest.raises(ValueError, match=message):
        mix(base, tuned, 0.5, tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()
