"""`python -m benchmarks.cache_logprobs` on two real built-in engines and the learner, tiny
model, float32: each condition leaves the cache it claims (the engine's own `cached_tokens`),
a rerun and a KV import reproduce what they should, and the learner's logprobs line up with
the engine's (a position off by one would be nats away)."""

import pytest

from benchmarks.cache_logprobs import (
    CONDITIONS,
    NUM_TOKENS,
    LearnerScores,
    compared,
    condition_row,
    markdown,
    measure_engines,
    prompts_of,
)

LENGTHS = [40, 200]


@pytest.fixture(scope="module")
def measured(tiny_model_dir):
    prompts = prompts_of(tiny_model_dir, LENGTHS)
    return prompts, LearnerScores(tiny_model_dir)


async def test_conditions_leave_the_cache_they_name_and_agree_where_they_must(
        measured, tiny_model_dir):
    prompts, learner = measured
    assert [len(p) for p in prompts] == [40, 40, 200, 200]
    runs = await measure_engines(tiny_model_dir, "float32", prompts)
    for ids, outcomes in zip(prompts, runs, strict=True):
        assert list(outcomes) == list(CONDITIONS)
        cached = {name: outcome.cached_tokens for name, outcome in outcomes.items()}
        assert cached == {"cold": 0, "cold_again": 0, "cached": len(ids) - 1,
                          "half_cached": len(ids) // 2, "chunked": 0,
                          "kv_imported": len(ids) - 1, "re_prefilled": 0}
        cold, resumed = outcomes["cold"], outcomes["re_prefilled"]
        assert len(cold.logprobs) == len(cold.output_ids) == NUM_TOKENS
        assert outcomes["cold_again"] == cold  # the engine repeats itself exactly
        assert outcomes["kv_imported"].logprobs == pytest.approx(
            outcomes["cached"].logprobs, abs=1e-6)  # the same KV, moved
        assert resumed.first == NUM_TOKENS // 2
        assert resumed.output_ids[:resumed.first] == cold.output_ids[:resumed.first]
        positions, flipped = compared(cold, resumed)
        assert positions == list(range(resumed.first, NUM_TOKENS)) or flipped
    rows = [condition_row(name, prompts, runs, learner) for name in CONDITIONS]
    by_name = {row["condition"]: row for row in rows}
    assert by_name["cold_again"]["drift_max"] == 0.0
    assert by_name["cold"]["num_compared"] == NUM_TOKENS * len(prompts)
    assert all(row["mismatch_max"] < 1e-3 for row in rows), rows
    table = markdown([{"model": "tiny", "dtype": "float32", **row} for row in rows])
    assert table.count("\n") == len(CONDITIONS) + 1
