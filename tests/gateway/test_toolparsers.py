"""The tool-call and reasoning parsers, one family at a time, fed whole, one character
at a time, and split in two at every position (a stream can break anywhere); the
events joined must be the same every way. Also detection from a template's text."""

import json

import pytest
import xgrammar

from undertow.gateway.front.toolparsers import (
    PARSERS,
    Content,
    Reasoning,
    ToolCall,
    Unparsed,
    create_parser,
    forced_structural_tag,
    parser_of_template,
)

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"},
                                     "flags": {"type": "array"}}}}}]


def run(name: str, pieces: list[str], parse_tools: bool = True, prompt_tail: str = ""):
    parser = create_parser(name, parse_tools=parse_tools, tools=TOOLS, prompt_tail=prompt_tail)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    return (content, reasoning, [e for e in events if isinstance(e, ToolCall)],
            sum(isinstance(e, Unparsed) for e in events))


def splits(text: str):
    """The text whole, one character at a time, and cut in two at every position."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def check_every_split(name: str, text: str, expected, **options) -> None:
    for pieces in splits(text):
        assert run(name, pieces, **options) == expected, pieces


BASH = ToolCall("bash", {"cmd": "ls -la", "timeout": 5})
READ = ToolCall("bash", {"cmd": "cat ä.py", "timeout": 10, "flags": ["-n"]})

CASES = {
    "hermes": ('<think>\nLook first.\n</think>\n\nLet me look.\n<tool_call>\n'
               '{"name": "bash", "arguments": {"cmd": "ls -la", "timeout": 5}}\n</tool_call>\n'
               '<tool_call>\n{"name": "bash", "arguments": "{\\"cmd\\": \\"cat ä.py\\", '
               '\\"timeout\\": 10, \\"flags\\": [\\"-n\\"]}"}\n</tool_call>',
               ("Let me look.", "Look first.", [BASH, READ], 0)),
    "qwen3_coder": ("<think>\nLook first.\n</think>\n\nLet me look.\n<tool_call>\n"
                    "<function=bash>\n<parameter=cmd>\nls -la\n</parameter>\n"
                    "<parameter=timeout>\n5\n</parameter>\n</function>\n</tool_call>\n"
                    "<tool_call>\n<function=bash>\n<parameter=cmd>\ncat ä.py\n</parameter>\n"
                    "<parameter=timeout>\n10\n</parameter>\n<parameter=flags>\n[\"-n\"]\n"
                    "</parameter>\n</function>\n</tool_call>",
                    ("Let me look.", "Look first.", [BASH, READ], 0)),
    "glm45": ("<think>Look first.</think>\nLet me look.\n<tool_call>bash\n<arg_key>cmd</arg_key>\n"
              "<arg_value>ls -la</arg_value>\n<arg_key>timeout</arg_key>\n<arg_value>5"
              "</arg_value>\n</tool_call><tool_call>bash\n<arg_key>cmd</arg_key>\n"
              "<arg_value>cat ä.py</arg_value>\n<arg_key>timeout</arg_key>\n<arg_value>10"
              "</arg_value>\n<arg_key>flags</arg_key>\n<arg_value>[\"-n\"]</arg_value>\n"
              "</tool_call>",
              ("Let me look.", "Look first.", [BASH, READ], 0)),
    "deepseek_v3": ("Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                    "bash\n```json\n{\"cmd\": \"ls -la\", \"timeout\": 5}\n```<｜tool▁call▁end｜>\n"
                    "<｜tool▁call▁begin｜>bash<｜tool▁sep｜>{\"cmd\": \"cat ä.py\", "
                    "\"timeout\": 10, \"flags\": [\"-n\"]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                    ("Let me look.", "", [BASH, READ], 0)),
    "llama3_json": ('{"name": "bash", "parameters": {"cmd": "ls -la", "timeout": 5}}; '
                    '{"name": "bash", "parameters": {"cmd": "cat ä.py", "timeout": 10, '
                    '"flags": ["-n"]}}',
                    ("", "", [BASH, READ], 0)),
    "kimi_k2": ("<think>Look first.</think>Let me look.<|tool_calls_section_begin|>"
                "<|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>"
                "{\"cmd\": \"ls -la\", \"timeout\": 5}<|tool_call_end|><|tool_call_begin|>"
                "functions.bash:1<|tool_call_argument_begin|>{\"cmd\": \"cat ä.py\", "
                "\"timeout\": 10, \"flags\": [\"-n\"]}<|tool_call_end|>"
                "<|tool_calls_section_end|><|im_end|>",
                ("Let me look.", "Look first.", [BASH, READ], 0)),
    "harmony": ("<|channel|>analysis<|message|>Look first.<|end|><|start|>assistant"
                "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.bash <|constrain|>json<|message|>"
                "{\"cmd\": \"ls -la\", \"timeout\": 5}<|call|>",
                ("Let me look.", "Look first.", [BASH], 0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reasoning_content_and_calls_at_every_split(name):
    text, expected = CASES[name]
    check_every_split(name, text, expected)


def test_deepseek_r1_reasoning_opened_by_the_prompt():
    text = "Look first.\n</think>\n\nDone ä."
    check_every_split("deepseek_r1", text, ("Done ä.", "Look first.", [], 0),
                      prompt_tail="<｜Assistant｜><think>\n")
    # Without the prompt's open tag the same text is all content.
    assert run("deepseek_r1", [text])[1] == ""


def test_harmony_final_answer_streams_and_analysis_is_reasoning():
    text = ("<|channel|>analysis<|message|>Think ä.<|end|><|start|>assistant<|channel|>final"
            "<|message|>The answer.<|return|>")
    check_every_split("harmony", text, ("The answer.", "Think ä.", [], 0))
    # A special token after the last message (end of text) is no content.
    check_every_split("harmony", text + "<|endoftext|>", ("The answer.", "Think ä.", [], 0))
    parser = create_parser("harmony")
    streamed = parser.feed("<|channel|>final<|message|>The ans")
    assert streamed == [Content("The ans")]  # streamed before the message ends


def test_llama3_plain_answer_streams_as_content():
    parser = create_parser("llama3_json", tools=TOOLS)
    assert parser.feed("Hello") == [Content("Hello")]
    assert run("llama3_json", ['{"answer": 42}']) == ('{"answer": 42}', "", [], 0)


MALFORMED = {
    "hermes": "Try.\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {oops}\n</tool_call>",
    "qwen3_coder": "Try.\n<tool_call>\n<function=bash>\n<parameter=cmd>\nls\n</parameter>\n"
                   "</function>\ntrailing words\n</tool_call>",
    "glm45": "Try.\n<tool_call>\n<arg_key>cmd</arg_key><arg_value>ls</arg_value></tool_call>",
    "deepseek_v3": "Try.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>bash\n"
                   "```json\n{\"cmd\": \n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "llama3_json": "{\"name\": \"bash\", \"parameters\": {\"cmd\": ",
    "harmony": ("<|channel|>commentary to=functions.bash <|constrain|>json<|message|>"
                "{\"cmd\"<|call|>"),
    "forced": "[{\"name\": \"bash\", \"parameters\": {\"cmd\": \"ls\"",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_call_is_returned_as_text_and_flagged(name):
    text = MALFORMED[name]
    for pieces in splits(text):
        content, _, calls, num_unparsed = run(name, pieces)
        assert calls == [] and num_unparsed == 1, pieces
        # Nothing the model wrote is dropped (only separator whitespace may go).
        assert "".join(content.split()) == "".join(text.split()), pieces


def test_forced_calls_parse_the_constrained_list():
    """Calls recorded forced as a JSON list (before forced calls were written in the
    model's own format) still replay."""
    text = '[{"name": "bash", "parameters": {"cmd": "ls -la", "timeout": 5}}]'
    check_every_split("forced", text, ("", "", [BASH], 0))


@pytest.mark.parametrize("name", sorted(set(PARSERS) - {"forced"}))
def test_every_parser_forces_calls_with_a_structural_tag_that_compiles(name):
    """Each format's forced calls are a structural tag xgrammar (SGLang's grammar library)
    compiles; the `forced` parser only reads old records and forces nothing."""
    tag = json.loads(forced_structural_tag(PARSERS[name], TOOLS, None))
    assert tag["type"] == "structural_tag"
    xgrammar.Grammar.from_structural_tag(json.dumps(tag))
    with pytest.raises(ValueError, match="forced"):
        forced_structural_tag(PARSERS["forced"], TOOLS, None)


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "glm45", "deepseek_v3"])
def test_tools_off_leaves_calls_as_text(name):
    content, _, calls, _ = run(name, [CASES[name][0]], parse_tools=False)
    assert calls == [] and "bash" in content


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_plain_text_is_kept_exactly(step):
    text = "Plain answer with a < sign and <tool_c half tag\n\n"
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    assert run("hermes", pieces) == (text, "", [], 0)


def test_unterminated_call_at_stop_is_parsed():
    assert run("hermes", ['<tool_call>\n{"name": "bash", "arguments": {}}\n']) == (
        "", "", [ToolCall("bash", {})], 0)


def test_xml_values_follow_the_schema():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "flag": {"type": "boolean"}, "n": {"type": ["integer", "null"]},
        "name": {"type": "string"}, "extra": {}}}}}]
    block = ("<tool_call>\n<function=f>\n<parameter=flag>\nTrue\n</parameter>\n"
             "<parameter=n>\n12\n</parameter>\n<parameter=name>\ntrue\n</parameter>\n"
             "<parameter=extra>\n{\"a\": 1}\n</parameter>\n</function>\n</tool_call>")
    parser = create_parser("qwen3_coder", tools=tools)
    events = parser.feed(block) + parser.finish()
    assert events == [ToolCall("f", {"flag": True, "n": 12, "name": "true", "extra": {"a": 1}})]


def test_qwen3_coder_keeps_a_string_that_looks_like_a_number():
    text = ("<tool_call>\n<function=bash>\n<parameter=cmd>\n007\n</parameter>\n</function>\n"
            "</tool_call>")
    assert run("qwen3_coder", [text])[2] == [ToolCall("bash", {"cmd": "007"})]


@pytest.mark.parametrize(("template", "expected"), [
    ("{{ '<|start|>assistant<|channel|>final<|message|>' }}", "harmony"),
    ("{{ '<|tool_calls_section_begin|><|tool_call_begin|>' }}", "kimi_k2"),
    ("{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' }}", "deepseek_v3"),
    ("{{ '<tool_call>' ~ name ~ '<arg_key>' }}", "glm45"),
    ("{{ '<tool_call>\\n<function=' ~ name ~ '>\\n<parameter=' }}", "qwen3_coder"),
    ("{{ '<tool_call>\\n' ~ call | tojson }}", "hermes"),
    ("{%- if message.role == 'ipython' %}{{ '<|python_tag|>' }}{% endif %}", "llama3_json"),
    ("{{ messages[0].content }}", "hermes"),
])
def test_detection_from_the_template(template, expected):
    assert parser_of_template(template) == expected


def test_registry_names_each_family_and_refuses_unknown():
    assert PARSERS["qwen"] is PARSERS["hermes"] is PARSERS["undertow"]
    assert PARSERS["gpt_oss"] is PARSERS["harmony"]
    with pytest.raises(ValueError, match="unknown tool parser"):
        create_parser("nope")
