"""The long-path case of `benchmarks.xlong`: what it reports for the unchunked LM head when
that does not fit in memory is an extrapolation that recovers a peak linear in the path's
tokens and a time a*T + b*T^2 exactly, and the table says it is one."""

import pytest

from benchmarks.xlong import learner_table
from benchmarks.xlong_learner import extrapolate, long_rows, probe_tokens

COUNTS = ("num_unique_tokens", "num_packed_tokens", "num_terms", "num_micro_batches",
          "longest_micro_batch")


def measured(tokens: int, variant: str = "unchunked") -> dict:
    """A row of a model whose step has a 300 MiB base plus 0.1 MiB per token and costs
    2e-3 s per token plus 3e-8 s per token pair (CPU), half that in wall seconds."""
    cpu_s = 2e-3 * tokens + 3e-8 * tokens ** 2
    return {"case": "path", "variant": variant, "peak_step_mib": 300 + 0.1 * tokens,
            "step_cpu_s": cpu_s, "step_s": cpu_s / 2, "loss": -0.5,
            "num_unique_tokens": tokens, "num_packed_tokens": tokens,
            "num_terms": tokens * 15 // 100, "num_micro_batches": 1,
            "longest_micro_batch": tokens}


def test_probes_are_24k_and_48k_for_a_128k_path():
    assert probe_tokens(131072) == (24576, 49152)


def test_extrapolation_recovers_a_linear_peak_and_a_quadratic_time():
    target = measured(131000, "chunked")
    row = extrapolate([measured(24000), measured(48000)], target)
    expected = measured(131000)
    for key in ("peak_step_mib", "step_cpu_s"):
        assert row[key] == pytest.approx(expected[key], rel=1e-9), key
    assert row["step_s"] is None    # wall seconds follow the load: not extrapolated
    assert {key: row[key] for key in COUNTS} == {key: target[key] for key in COUNTS}
    assert row["variant"] == "unchunked" and row["extrapolated_from"] == [24000, 48000]


def test_long_rows_label_the_probes_and_the_extrapolated_rows():
    rows = long_rows(131072, {"chunked": measured(131000, "chunked"),
                              "unchunked": [measured(24000), measured(48000)]},
                     max_rss_gib=12.0)
    assert [(r["case"], r["variant"]) for r in rows] == [
        ("path 24k (probe)", "unchunked"), ("path 48k (probe)", "unchunked"),
        ("path 128k", "unchunked"), ("path 128k", "chunked")]
    assert rows[2]["peak_step_mib"] == pytest.approx(300 + 0.1 * 131000)
    assert "extrapolated_from" not in rows[3]
    table = learner_table(rows)
    assert "| path 128k | unchunked, extrapolated from 24k and 48k |" in table
    assert "| path 128k | chunked |" in table
    assert table.count("| n/a |") == 1     # the extrapolated row's wall seconds


def test_with_probes_only_both_variants_are_extrapolated_to_the_paths_own_counts():
    probes = {v: [measured(3000, v), measured(6000, v)] for v in ("unchunked", "chunked")}
    rows = long_rows(16384, probes, max_rss_gib=12.0)
    long = [row for row in rows if row["case"] == "path 16k"]
    assert [(r["variant"], r["extrapolated_from"]) for r in long] == [
        ("unchunked", [3000, 6000]), ("chunked", [3000, 6000])]
    # The counts are the 16k path's own (packed whole: one micro-batch, 15% sampled).
    assert long[0]["num_packed_tokens"] == long[0]["longest_micro_batch"] == 16000
    assert long[0]["num_micro_batches"] == 1 and long[0]["num_terms"] == 16 * 150
    assert long[1]["peak_step_mib"] == pytest.approx(300 + 0.1 * 16000)
