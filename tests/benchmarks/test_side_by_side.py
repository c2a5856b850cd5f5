"""`benchmarks.side_by_side`: a results JSON's numbers by path, rows named by their method."""

from benchmarks.side_by_side import numbers


def test_numbers_are_found_by_path_and_rows_by_their_method_and_shape():
    results = {"max_tokens": 16384, "ok": True,
               "rows": [{"method": "tree", "shape": "scaled", "step_cpu_s": 2.5},
                        {"method": "per_session", "shape": "scaled", "step_cpu_s": 4.0},
                        [1, 2]]}
    assert dict(numbers(results)) == {"max_tokens": 16384.0,
                                      "rows/tree-scaled/step_cpu_s": 2.5,
                                      "rows/per_session-scaled/step_cpu_s": 4.0,
                                      "rows/2/0": 1.0, "rows/2/1": 2.0}
