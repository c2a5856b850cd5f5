"""`make device-check` on a machine without CUDA (benchmarks/device_check.py).

- The target runs the script, which exits 0 and prints its table with every learner and
  engine row "not run" with the reason "no CUDA", and the SGLang row from
  device_check_sglang.py (not run here, with SGLang's reason), and writes the same rows
  as JSON.
- The model FLOPs of a packed step are the hand count for one causal chain (matmuls per
  packed token, the head per scored token, attention per visible pair).
- The bf16 peak is matched on the device's name, the longest name first.
- (slow) The training rows' code runs on a one-process CPU mesh (gloo) and reports.
- `--checks` takes comma-separated parts or "all" and refuses unknown ones; rows of parts
  not picked are "not run", in the table's order.
- The pool row's comparison: the gradient error is relative to each parameter's scale
  and refuses a vacuous comparison; the row passes only within the tolerance, with
  every micro-batch trained once and both members training.
The pool row's whole path (two member processes) is not run here: on this shared CPU it
takes minutes (bf16 on the CPU, two process starts); `python -m benchmarks.device_check
--checks pool` runs it on a GPU, and `device_check.pool_row(model_dir, device_type="cpu",
shape=..., max_tokens=...)` dry-runs it on a CPU by hand.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import device_check

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check runs for real")
def test_make_device_check_without_cuda_prints_not_run_rows():
    done = subprocess.run(["make", "-s", "device-check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert lines[0] == "| check | status | value | note |"
    body = {line.split(" | ")[0][2:]: line for line in lines[1:]}
    assert set(body) == set(device_check.ROWS)
    for name in device_check.ROWS[:-1]:
        assert "| not run |" in body[name] and "no CUDA" in body[name], body[name]
    assert "| not run |" in body["SGLang checks"]
    written = json.loads(device_check.RESULTS.read_text())["rows"]
    assert [r["check"] for r in written] == list(device_check.ROWS)


def test_model_flops_of_one_causal_chain_are_the_hand_count():
    from undertow.gateway.trees.tree import Tree
    from undertow.learner.packing import pack_step

    tree = Tree("g")
    tree.add_call("c0", "s0", list(range(1, 7)), [7, 8, 9, 10], [-1.0] * 4, [0] * 4)
    tree.close_session("s0", reward=1.0)
    step = pack_step([tree], {("g", "s0"): 1.0}, 64)
    config = SimpleNamespace(hidden_size=8, head_dim=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=16,
                             num_hidden_layers=3, vocab_size=100)
    num_tokens = 10
    per_layer = 8 * (2 * 8 + 2 * 4) + 3 * 8 * 16
    expected = (6 * 3 * per_layer * num_tokens + 6 * 100 * 8 * 4
                + 12 * 3 * 8 * num_tokens * (num_tokens + 1) // 2)
    assert step.num_packed_tokens == num_tokens and step.num_terms == 4
    assert device_check.model_flops(config, step) == expected


def test_peak_flops_match_the_device_name():
    assert device_check.peak_flops("NVIDIA H200") == 989e12
    assert device_check.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert device_check.peak_flops("NVIDIA L40S") == 362e12   # not L4's
    assert device_check.peak_flops("Some Future GPU") is None


@pytest.mark.slow
def test_the_training_rows_run_on_a_one_process_cpu_mesh(tiny_model_dir):
    """The GPU path's training part, dry-run on a CPU: FSDP2 over a one-process gloo mesh,
    bf16 compute, activation checkpointing, three steps, the weights gathered and written."""
    rows = {r["check"]: r for r in device_check.train_rows(tiny_model_dir, "scaled",
                                                           device_type="cpu")}
    tokens = rows["training tokens/s"]
    assert tokens["status"] == "passed" and float(tokens["value"].replace(",", "")) > 0
    assert "no peak known for CPU" in rows["model FLOPs utilisation"]["note"]
    assert float(rows["weight sync, learner side (s)"]["value"]) > 0


def test_checks_pick_parts_and_the_rest_are_not_run():
    assert device_check.parse_checks("all") == tuple(device_check.PARTS)
    assert device_check.parse_checks("pool, train") == ("train", "pool")
    for bad in ("pool,warp", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="pick from"):
            device_check.parse_checks(bad)
    parser_error = subprocess.run(
        [sys.executable, "-m", "benchmarks.device_check", "--checks", "warp"], cwd=ROOT,
        capture_output=True, text=True, timeout=120)
    assert parser_error.returncode == 2 and "unknown checks ['warp']" in parser_error.stderr
    pool = device_check.row(device_check.ROWS[6], "passed", "gradient 0.0e+00")
    error = device_check.row("error (train)", "FAILED", note="boom")
    rows = device_check.in_table_order([error, pool], ("train", "pool"))
    names = device_check.ROWS   # train's own rows are missing: it failed, with an error row
    assert [r["check"] for r in rows] == [names[2], names[4], names[5], names[6], names[7],
                                          "error (train)"]
    assert [r["status"] for r in rows] == ["not run"] * 3 + ["passed", "not run", "FAILED"]
    assert rows[1]["note"] == "not picked (--checks)"


def test_the_gradient_error_is_relative_to_each_parameter():
    expected = {"a": torch.tensor([1.0, -4.0]), "b": torch.tensor([0.001, 0.0])}
    got = {"a": torch.tensor([1.0, -3.96]), "b": torch.tensor([0.0011, 0.0])}
    assert device_check.gradient_error(got, expected) == pytest.approx(0.1)   # b's
    assert device_check.gradient_error(expected, expected) == 0.0
    with pytest.raises(ValueError, match="zero"):
        device_check.gradient_error(got, {**expected, "b": torch.zeros(2)})
    with pytest.raises(ValueError, match="other parameters"):
        device_check.gradient_error({"a": got["a"]}, expected)


def test_the_pool_row_passes_only_an_exact_full_split_step():
    both = {"cell-0": [0, 2], "cell-1": [1, 3]}
    assert device_check.pool_status(1e-6, both, 4)[0] == "passed"
    status, note = device_check.pool_status(5e-3, both, 4)
    assert status == "FAILED" and "gradient error 5.0e-03" in note
    status, note = device_check.pool_status(0.0, {"cell-0": [0, 1, 2], "cell-1": [2]}, 4)
    assert status == "FAILED" and "not each of 4 once" in note
    status, note = device_check.pool_status(0.0, {"cell-0": [0, 1, 2, 3], "cell-1": []}, 4)
    assert status == "FAILED" and "['cell-1'] trained nothing" in note

