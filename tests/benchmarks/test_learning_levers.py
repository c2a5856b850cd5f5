"""`python -m benchmarks.learning_levers`: the prompts it times (engine runs: timing only)."""

import pytest

from benchmarks.learning_levers import agent_prompts, markdown, render

STATEMENT = "`rule` in `textfmt/rule.py` uses 96 instead of 44\n\nI expected 44.\n"


def test_each_prompt_config_renders_a_second_call_that_extends_the_first(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    lengths = {}
    for name, (agent, tool) in agent_prompts().items():
        first = render(tokenizer, agent, tool, STATEMENT, second_turn=False)
        second = render(tokenizer, agent, tool, STATEMENT, second_turn=True)
        assert tokenizer.decode(first).count("textfmt/rule.py") == 1, name
        assert second[:len(first) - 3] == first[:-3], name  # all but the generation prompt
        lengths[name] = len(first)
    assert lengths["learning_mini_swe_agent.yaml"] * 5 < lengths["swebench.yaml (tool call)"]


def test_the_table_has_a_row_per_prompt_config_and_concurrency():
    result = {"prompts": [{"prompt": "short", "first_prompt_tokens": [150, 161],
                           "second_prompt_tokens": [190, 201], "first_prefill_s": 1.234,
                           "second_cached_s": 0.3, "second_flushed_s": 1.5}],
              "decode": [{"concurrency": 1, "tokens_per_s": 4.56},
                         {"concurrency": 8, "tokens_per_s": 19.8}]}
    lines = markdown(result).splitlines()
    assert lines[2] == "| short | 161 | 1.23 | 201 | 0.30 | 1.50 |"
    assert lines[-2:] == ["| 1 | 4.6 |", "| 8 | 19.8 |"]
