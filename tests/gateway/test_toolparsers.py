"""The Hermes/Qwen tool-call parser (the built-in model's format), fed whole and
character by character."""

import pytest

from undertow.gateway.toolparsers import PARSERS, Content, Reasoning, ToolCall, create_parser

COMPLETION = ('<think>\nI should look first.\n</think>\n\nLet me look.\n<tool_call>\n'
              '{"name": "bash", "arguments": {"cmd": "ls -la"}}\n</tool_call>\n<tool_call>\n'
              '{"name": "read", "arguments": "{\\"path\\": \\"a.py\\"}"}\n</tool_call>')


def parse(text: str, step: int, parse_tools: bool = True):
    parser = create_parser("undertow", parse_tools=parse_tools)
    events = []
    for start in range(0, len(text), step):
        events += parser.feed(text[start:start + step])
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    return content, reasoning, [e for e in events if isinstance(e, ToolCall)]


@pytest.mark.parametrize("step", [1, 2, 7, 10_000])
def test_reasoning_content_and_tool_calls(step):
    content, reasoning, calls = parse(COMPLETION, step)
    assert reasoning == "I should look first."
    assert content == "Let me look."
    assert calls == [ToolCall("bash", {"cmd": "ls -la"}), ToolCall("read", {"path": "a.py"})]


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_plain_text_is_kept_exactly(step):
    text = "Plain answer with a < sign and <tool_c half tag\n\n"
    assert parse(text, step) == (text, "", [])


def test_invalid_json_block_stays_content():
    text = "<tool_call>\nnot json\n</tool_call>"
    assert parse(text, 1) == ("<tool_call>\nnot json\n</tool_call>", "", [])


def test_unterminated_call_at_stop_is_parsed():
    content, _, calls = parse('<tool_call>\n{"name": "x", "arguments": {}}\n', 4)
    assert content == "" and calls == [ToolCall("x", {})]


def test_tools_off_leaves_text():
    content, _, calls = parse(COMPLETION, 5, parse_tools=False)
    assert calls == [] and "<tool_call>" in content


def test_registry_names_the_family_and_refuses_unknown():
    assert PARSERS["qwen"] is PARSERS["hermes"] is PARSERS["undertow"]
    with pytest.raises(ValueError, match="unknown tool parser"):
        create_parser("nope")
