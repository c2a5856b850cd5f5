"""A test fixture: a model directory like the tiny model's, whose chat template behaves
as Qwen3-Coder-style thinking templates do in what the reasoning tests need:

- the generation prompt opens the think block itself (`<think>\\n`, as Qwen3's
  thinking-2507 and DeepSeek-R1's templates do), or writes an empty one when
  `enable_thinking` is false (as Qwen3's template does);
- `reasoning_effort`, when given, is written into a system line (as gpt-oss's is);
- tool calls are written in Qwen3-Coder's XML (`<function=...><parameter=...>`), so
  `--tool-parser auto` picks `qwen3_coder`.

`HARMONY` is a small template in gpt-oss's harmony layout (messages on channels, the
generation prompt ending with `<|start|>assistant`), so `auto` picks `harmony`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TEMPLATE = """
{%- if reasoning_effort is defined -%}
    {{- '<|im_start|>system\\nReasoning: ' ~ reasoning_effort ~ '<|im_end|>\\n' -}}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n# Tools\\n' -}}
    {%- for tool in tools -%}
        {{- '\\n' ~ (tool | tojson) -}}
    {%- endfor -%}
    {{- '\\nCall one as <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n'
        ~ '</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if message.reasoning_content is string -%}
            {{- '<think>\\n' ~ message.reasoning_content ~ '\\n</think>\\n\\n' -}}
        {%- endif -%}
        {{- message.content or '' -}}
        {%- for tool_call in message.tool_calls or [] -%}
            {%- set call = tool_call.function -%}
            {{- '\\n<tool_call>\\n<function=' ~ call.name ~ '>\\n' -}}
            {{- '<parameter=arguments>\\n' ~ call.arguments ~ '\\n</parameter>\\n' -}}
            {{- '</function>\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {{- '<|im_start|>user\\n<tool_response>\\n' ~ message.content
            ~ '\\n</tool_response><|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- else -%}
        {{- '<think>\\n' -}}
    {%- endif -%}
{%- endif -%}
"""

HARMONY = """
{%- for message in messages -%}
    {%- if message.role == 'assistant' and message.reasoning_content is string -%}
        {{- '<|start|>assistant<|channel|>analysis<|message|>' ~ message.reasoning_content
            ~ '<|end|>' -}}
    {%- endif -%}
    {%- if message.role == 'assistant' and message.tool_calls -%}
        {%- for tool_call in message.tool_calls -%}
            {{- '<|start|>assistant<|channel|>commentary to=functions.' ~ tool_call.function.name
                ~ ' <|constrain|>json<|message|>' ~ tool_call.function.arguments ~ '<|call|>' -}}
        {%- endfor -%}
    {%- elif message.role == 'assistant' -%}
        {{- '<|start|>assistant<|channel|>final<|message|>' ~ message.content ~ '<|end|>' -}}
    {%- else -%}
        {{- '<|start|>' ~ message.role ~ '<|message|>' ~ message.content ~ '<|end|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start|>assistant' -}}
{%- endif -%}
"""


def thinking_model_dir(tiny_model_dir: Path, out: Path, template: str = TEMPLATE) -> Path:
    """A copy of the tiny model directory with `template` as its chat template."""
    shutil.copytree(tiny_model_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template.strip()
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return out
