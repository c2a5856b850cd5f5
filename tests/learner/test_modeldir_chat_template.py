"""The built models' chat template: what it renders for tools, tool calls, thinking and
tool results, that transformers renders it the same, and the prefix property the
gateway's token truth needs."""

import itertools

import pytest

from undertow.learner.modeldir.chat_template import ChatTemplateError, render_chat

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a command <in> the sandbox & return its output",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": [{"type": "text", "text": "Fix "}, {"type": "text", "text": "é"}]},
    {"role": "assistant", "reasoning_content": "Look first.", "content": "Listing.",
     "tool_calls": [
         {"id": "a", "type": "function",
          "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
         {"id": "b", "type": "function",
          "function": {"name": "bash", "arguments": {"command": "cat 日本.py"}}}]},
    {"role": "tool", "tool_call_id": "a", "content": "日本.py"},
    {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "x = 1"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function",
         "function": {"name": "bash", "arguments": '{"command":"pytest"}'}}]},
    {"role": "tool", "tool_call_id": "c", "content": "1 passed"},
    {"role": "assistant", "reasoning_content": "", "content": "Done."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},
]
# What the model writes after `<|im_start|>assistant\n` for each assistant message.
COMPLETIONS = {
    2: ('<think>\nLook first.\n</think>\n\nListing.\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "cat 日本.py"}}\n</tool_call>'),
    5: '<tool_call>\n{"name": "bash", "arguments": {"command":"pytest"}}\n</tool_call>',
    7: "<think>\n\n</think>\n\nDone.",
    9: "You're welcome.",
}
TOOLS_SYSTEM_TURN = (
    "<|im_start|>system\nYou fix bugs.\n\n# Tools\n\nYou can call these functions. Their "
    "signatures are listed inside <tools></tools>:\n<tools>\n"
    '{"type": "function", "function": {"name": "bash", "description": "Run a command <in> '
    'the sandbox & return its output", "parameters": {"type": "object", "properties": '
    '{"command": {"type": "string"}}, "required": ["command"]}}}\n</tools>\n\n'
    "To call a function, answer with a JSON object holding its name and arguments inside "
    '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<arguments-object>}\n</tool_call><|im_end|>\n")


def test_renders_tools_tool_calls_thinking_and_tool_results():
    expected = (
        TOOLS_SYSTEM_TURN
        + "<|im_start|>user\nFix é<|im_end|>\n"
        + f"<|im_start|>assistant\n{COMPLETIONS[2]}<|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\n日本.py\n</tool_response><|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\nx = 1\n</tool_response><|im_end|>\n"
        + f"<|im_start|>assistant\n{COMPLETIONS[5]}<|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\n1 passed\n</tool_response><|im_end|>\n"
        + f"<|im_start|>assistant\n{COMPLETIONS[7]}<|im_end|>\n"
        + "<|im_start|>user\nThanks<|im_end|>\n"
        + f"<|im_start|>assistant\n{COMPLETIONS[9]}<|im_end|>\n")
    assert render_chat(CONVERSATION, tools=TOOLS) == expected


def test_without_tools_the_system_turn_is_plain_and_the_prompt_opens_an_assistant_turn():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert render_chat(messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_tools_without_a_system_message_get_their_own_system_turn():
    rendered = render_chat([{"role": "user", "content": "hi"}], tools=TOOLS)
    assert rendered.startswith("<|im_start|>system\n# Tools\n\n")
    assert rendered.endswith("</tool_call><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")


@pytest.mark.parametrize("index", sorted(COMPLETIONS))
def test_prompt_plus_completion_is_a_prefix_of_the_longer_conversation(index):
    prompt = render_chat(CONVERSATION[:index], tools=TOOLS, add_generation_prompt=True)
    assert render_chat(CONVERSATION, tools=TOOLS).startswith(
        prompt + COMPLETIONS[index] + "<|im_end|>")


def test_every_shorter_conversation_renders_as_a_prefix():
    # From one message on: with no messages at all, the system turn holds only the tools.
    renders = [render_chat(CONVERSATION[:k], tools=TOOLS) for k in range(1, len(CONVERSATION) + 1)]
    for shorter, longer in itertools.pairwise(renders):
        assert longer.startswith(shorter)
        assert len(longer) > len(shorter)


@pytest.mark.parametrize("index", sorted(COMPLETIONS))
def test_prompt_and_completion_token_ids_are_a_prefix_of_the_conversations(
        tiny_model_dir, index):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = render_chat(CONVERSATION[:index], tools=TOOLS, add_generation_prompt=True)
    token_ids = (tokenizer.encode(prompt, add_special_tokens=False)
                 + tokenizer.encode(COMPLETIONS[index], add_special_tokens=False)
                 + [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    full_ids = tokenizer.encode(render_chat(CONVERSATION, tools=TOOLS), add_special_tokens=False)
    assert full_ids[:len(token_ids)] == token_ids


def test_transformers_renders_the_same_text(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for messages, generation_prompt in ((CONVERSATION, False), (CONVERSATION[:5], True)):
        assert tokenizer.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=generation_prompt,
        ) == render_chat(messages, tools=TOOLS, add_generation_prompt=generation_prompt)


@pytest.mark.parametrize(("message", "error"), [
    ({"role": "robot", "content": "x"}, "Unknown role robot"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "image_url"),
])
def test_unrenderable_messages_say_what_is_wrong(message, error):
    with pytest.raises(ChatTemplateError, match=error):
        render_chat([message])
