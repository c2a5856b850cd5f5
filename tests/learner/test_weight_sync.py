"""Weight sync to SGLang-protocol engines: a gloo broadcast to real receiver processes that
follow SGLang 0.5.23's side of the group (`sglang_weight_receiver.py`), and the fallback to disk."""

import contextlib
import json
import logging
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from undertow.learner.weight_sync import EngineWeightSync, WeightSyncConfig

LISTENING = "listening on "
CPU_CONFIG = WeightSyncConfig(method="distributed", backend="gloo", group_timeout_s=60.0)


@contextlib.contextmanager
def receivers(model_dir: Path, count: int, *flags: str):
    """`count` receiver processes serving `model_dir`'s weights; yields their URLs."""
    processes = [subprocess.Popen(
        [sys.executable, "-m", "tests.learner.sglang_weight_receiver", "--model",
         str(model_dir), *flags], stdout=subprocess.PIPE, text=True) for _ in range(count)]
    try:
        urls = []
        for process in processes:
            line = process.stdout.readline()
            assert line.startswith(LISTENING), f"the receiver printed {line!r}"
            urls.append(line[len(LISTENING):].strip())
        yield urls
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
            process.stdout.close()


def call(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def engine_tensors(url: str, path: Path) -> dict[str, torch.Tensor]:
    call(url, "/undertow_test/save", {"path": str(path)})
    return load_file(str(path))


def new_weights(model_dir: Path, out: Path, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights moved by a seeded step, written as a model directory at `out`."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: t + 0.01 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
               for name, t in load_file(str(model_dir / "model.safetensors")).items()}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    return tensors


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_two_engines_receive_the_learners_tensors_by_broadcast(tiny_model_dir, tmp_path):
    step1 = new_weights(tiny_model_dir, tmp_path / "step1", seed=1)
    with receivers(tiny_model_dir, 2) as urls:
        sync = EngineWeightSync(urls, CPU_CONFIG)
        sync.push(tmp_path / "step1", 1)
        for i, url in enumerate(urls):
            assert_same(engine_tensors(url, tmp_path / f"engine{i}-1.safetensors"), step1)
            assert call(url, "/model_info")["weight_version"] == "1"
        # The same group again, with tensors that exist only in the learner's memory.
        in_memory = {name: t * 2 for name, t in step1.items()}
        sync.named_tensors = in_memory.items
        sync.push(tmp_path / "step1", 2)
        for i, url in enumerate(urls):
            assert_same(engine_tensors(url, tmp_path / f"engine{i}-2.safetensors"), in_memory)
            assert call(url, "/model_info")["weight_version"] == "2"
        sync.close()
    assert [r.method for r in sync.reports] == ["distributed", "distributed"]
    assert all(r.fallback_error is None for r in sync.reports)
    assert sync.reports[0].num_bytes == sum(t.numel() * t.element_size() for t in step1.values())


def test_an_engine_that_cannot_join_gets_the_weights_from_disk(tiny_model_dir, tmp_path,
                                                              caplog):
    step1 = new_weights(tiny_model_dir, tmp_path / "step1", seed=2)
    with receivers(tiny_model_dir, 1, "--fail-init") as urls, \
            caplog.at_level(logging.WARNING, logger="undertow.learner.weight_sync"):
        sync = EngineWeightSync(urls, CPU_CONFIG)
        sync.push(tmp_path / "step1", 1)
        assert_same(engine_tensors(urls[0], tmp_path / "engine.safetensors"), step1)
        assert call(urls[0], "/model_info")["weight_version"] == "1"
    report = sync.reports[-1]
    assert report.method == "disk"
    assert "Failed to initialize custom process group" in report.fallback_error
    assert "loading them from disk" in caplog.text and "init_weights_update_group" in caplog.text


def test_weights_an_engine_cannot_load_fall_back_to_disk(tiny_model_dir, tmp_path):
    step1 = new_weights(tiny_model_dir, tmp_path / "step1", seed=3)
    with receivers(tiny_model_dir, 1) as urls:
        sync = EngineWeightSync(urls, CPU_CONFIG)
        sync.named_tensors = lambda: [*step1.items(), ("model.extra.weight", torch.ones(3))]
        sync.push(tmp_path / "step1", 1)
        assert_same(engine_tensors(urls[0], tmp_path / "engine.safetensors"), step1)
        assert call(urls[0], "/model_info")["weight_version"] == "1"
    assert sync.reports[-1].method == "disk"
    assert "model.extra.weight" in sync.reports[-1].fallback_error


def test_an_unknown_method_or_backend_is_named():
    with pytest.raises(ValueError, match="'rdma' is unknown"):
        WeightSyncConfig(method="rdma")
    with pytest.raises(ValueError, match="backend='mpi'"):
        WeightSyncConfig(backend="mpi")
