"""`python -m benchmarks.migration_cost` on two real built-in engines, short contexts: every
arm ends at the same next token, the KV arms with all but the last token cached on the
target and re-prefill with none, the payload as large as the model's KV of those tokens, and
the table built from the runs."""

import json

from benchmarks.migration_cost import ARMS, markdown, measure, summarize

CONTEXTS = [96, 300]


def kv_bytes_per_token(model_dir) -> int:
    """float32 K and V of every layer, from config.json (the payload's dtype)."""
    config = json.loads((model_dir / "config.json").read_text())
    return (config["num_hidden_layers"] * 2 * config["num_key_value_heads"]
            * config["head_dim"] * 4)


async def test_every_arm_reaches_the_same_token_and_kv_arms_prefill_one(tiny_model_dir):
    rows = await measure(tiny_model_dir, CONTEXTS, num_reps=1)
    assert sorted((r["arm"], r["context_tokens"]) for r in rows) == sorted(
        (arm, length) for arm in ARMS for length in CONTEXTS)
    for length in CONTEXTS:
        runs = {r["arm"]: r for r in rows if r["context_tokens"] == length}
        assert len({r["next_token"] for r in runs.values()}) == 1, runs
        assert runs["re_prefill"]["cached_tokens"] == 0
        for arm in ("kv_import", "kv_staged"):
            assert runs[arm]["cached_tokens"] == length - 1
            payload_floor = (length - 1) * kv_bytes_per_token(tiny_model_dir)
            assert payload_floor < runs[arm]["payload_bytes"] < payload_floor + 64 * length
        assert runs["kv_staged"]["pause_ms"] == runs["kv_staged"]["calls_ms"]["generate_staged"]
        assert runs["re_prefill"]["pause_ms"] == runs["re_prefill"]["ms"]
    table = summarize(rows, CONTEXTS)
    assert [e["context_tokens"] for e in table] == CONTEXTS
    assert all(e["same_next_token"] for e in table)
    for entry in table:
        assert entry["re_prefill_over_kv_import"] == (entry["re_prefill_ms"]
                                                      / entry["kv_import_ms"])
    assert markdown(table).count("\n") == len(CONTEXTS) + 1
