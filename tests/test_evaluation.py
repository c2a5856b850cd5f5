"""pass@k, intervals and the paired comparison of `undertow eval`, against brute force."""

import itertools
import json
import math

import numpy as np
import pytest

from undertow.cli import main
from undertow.evaluation import (
    compare,
    difference_interval,
    evaluate,
    outcomes,
    pass_at_k,
    sign_flip_p_value,
    wilson_interval,
)


def _brute_pass_at_k(n, c, k):
    """The fraction of k-subsets of the n samples that hold at least one correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


def test_pass_at_k_equals_the_fraction_of_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k))
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_wilson_interval_known_values():
    low, high = wilson_interval(5, 10)
    assert (round(low, 4), round(high, 4)) == (0.2366, 0.7634)
    assert wilson_interval(0, 4)[0] == 0.0 and wilson_interval(4, 4)[1] == pytest.approx(1.0)


def test_difference_interval_matches_newcombes_table():
    # Newcombe (1998), Statistics in Medicine 17:873, Table II, method 10 (p_a - p_b there).
    for (c_b, n_b, c_a, n_a), expected in (((56, 70, 48, 80), (0.0524, 0.3339)),
                                            ((9, 10, 3, 10), (0.1705, 0.8090)),
                                            ((6, 7, 2, 7), (0.0582, 0.8062)),
                                            ((5, 56, 0, 29), (-0.0381, 0.1926))):
        low, high = difference_interval(c_a, n_a, c_b, n_b)
        assert (round(low, 4), round(high, 4)) == expected
    assert difference_interval(48, 80, 56, 70)[0] > 0 > difference_interval(56, 70, 48, 80)[1]


def _summary(results):
    return {"sessions": [{"instance_id": task, "resolved": resolved, "cause": cause}
                         for task, runs in results.items() for resolved, cause in runs]}


def test_evaluate_per_task_and_overall():
    summary = _summary({"a": [(True, "exited"), (False, "exited"), (True, "timeout")],
                        "b": [(False, "exited")] * 3 + [(True, "error:grade")]})
    per_task, num_left_out = outcomes(summary)
    assert per_task == {"a": [True, False, True], "b": [False] * 3} and num_left_out == 1
    result = evaluate(per_task, k=2, label="ckpt", num_left_out=num_left_out)
    assert [t.pass_at_1 for t in result.tasks] == pytest.approx([2 / 3, 0.0])
    assert [t.pass_at_k for t in result.tasks] == pytest.approx([1.0, 0.0])
    assert result.pass_at_1 == pytest.approx(1 / 3)
    half = 1.959964 * np.std([2 / 3, 0.0], ddof=1) / math.sqrt(2)
    assert result.pass_at_1_interval == pytest.approx((0.0, 1 / 3 + half))
    with pytest.raises(ValueError, match="at least 4 sessions"):
        evaluate(per_task, k=4)


def test_sign_flip_p_value_exact_and_sampled():
    assert sign_flip_p_value(np.array([1.0, 1.0, 1.0])) == pytest.approx(2 / 8)
    assert sign_flip_p_value(np.array([1.0, -1.0])) == 1.0
    many = np.ones(20)
    assert sign_flip_p_value(many) < 0.001


def test_compare_pairs_common_tasks():
    a = evaluate({"x": [False, False], "y": [True, False], "z": [True, True]}, 1, "A")
    b = evaluate({"x": [True, True], "y": [True, True], "z": [True, True], "w": [True]}, 1, "B")
    comparison = compare(a, b)
    assert comparison.num_tasks == 3
    assert comparison.mean_difference == pytest.approx(0.5)
    assert (comparison.num_wins, comparison.num_losses, comparison.num_ties) == (2, 0, 1)
    # Differences (1, 0.5, 0): only the patterns with both signs equal reach 1.5 -> 4 of 8.
    assert comparison.p_value == pytest.approx(4 / 8)


def test_eval_command_scores_two_runs(tmp_path, capsys):
    runs = []
    for name, results in (("run-a", {"x": [False, False], "y": [True, False]}),
                          ("run-b", {"x": [True, False], "y": [True, True]})):
        run = tmp_path / name
        run.mkdir()
        (run / "summary.json").write_text(json.dumps(_summary(
            {task: [(r, "exited") for r in rs] for task, rs in results.items()})))
        runs += ["--from-run", str(run)]
    assert main(["eval", *runs, "-k", "2", "--out", str(tmp_path / "eval")]) == 0
    out = capsys.readouterr().out
    assert "| y | 2 | 1 | 0.500 |" in out and "| **all (2 tasks)** | | | 0.250 |" in out
    assert "run-b vs run-a on 2 tasks: pass@1 difference +0.500" in out
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["comparison"]["num_wins"] == 2
