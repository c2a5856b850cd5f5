'''The ChatML chat template of the built models, in Qwen/Hermes style (`CHAT_TEMPLATE`:
tools as JSON lines in `<tools>`, reasoning in `<think>`, calls in `<tool_call>`, tool
results as user turns in `<tool_response>`). It renders every message the same whatever
follows and never rewrites earlier turns, so rendering a conversation's first k messages is
a prefix of rendering all of them: what lets the gateway extend a session's token IDs
instead of re-tokenizing it. `render_chat` renders in the chat-template environment of
`gateway/trees/template_env.py`.
'''

from collections.abc import Mapping, Sequence
from typing import NoReturn

from undertow.gateway.trees.template_env import chat_template_environment
from undertow.learner.errors import LearnerError

CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is sequence and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('Only text content parts are supported, got type '
                                    ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if messages and messages[0].role == 'system' -%}
        {{- render_content(messages[0].content) ~ '\\n\\n' -}}
    {%- endif -%}
    {{- '# Tools\\n\\nYou can call these functions. '
        ~ 'Their signatures are listed inside <tools></tools>:\\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\\n' ~ (tool | tojson) -}}
    {%- endfor -%}
    {{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object holding its name '
        ~ 'and arguments inside <tool_call></tool_call> tags:\\n<tool_call>\\n'
        ~ '{"name": <function-name>, "arguments": <arguments-object>}\\n</tool_call>'
        ~ '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- if not (loop.first and tools) -%}
            {{- '<|im_start|>system\\n' ~ render_content(message.content) ~ '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\\n' ~ render_content(message.content) ~ '<|im_end|>\\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if message.reasoning_content is string -%}
            {{- '<think>\\n' ~ message.reasoning_content ~ '\\n</think>\\n\\n' -}}
        {%- endif -%}
        {%- set content = render_content(message.content) -%}
        {{- content -}}
        {%- for tool_call in message.tool_calls or [] -%}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
            {%- if content or not loop.first -%}
                {{- '\\n' -}}
            {%- endif -%}
            {{- '<tool_call>\\n{"name": ' ~ (call.name | tojson) ~ ', "arguments": ' -}}
            {%- if call.arguments is string -%}
                {{- call.arguments -}}
            {%- else -%}
                {{- call.arguments | tojson -}}
            {%- endif -%}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {{- '<|im_start|>user\\n<tool_response>\\n' ~ render_content(message.content)
            ~ '\\n</tool_response><|im_end|>\\n' -}}
    {%- else -%}
        {{- raise_exception('Unknown role ' ~ message.role
                            ~ '; use system, user, assistant or tool') -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""


class ChatTemplateError(LearnerError, ValueError):
    """The messages cannot be rendered; the message says which part to fix."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def render_chat(messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
                add_generation_prompt: bool = False) -> str:
    """The prompt text for `messages`, as `apply_chat_template(..., tokenize=False)` gives it."""
    template = chat_template_environment(_raise_exception).from_string(CHAT_TEMPLATE)
    return template.render(messages=list(messages), tools=list(tools) if tools else None,
                           add_generation_prompt=add_generation_prompt)
