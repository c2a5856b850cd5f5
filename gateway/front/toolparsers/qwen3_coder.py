"""Qwen3-Coder's XML tool calls, arguments written as text:

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

Values are converted to the types of the tool's parameter schema (a string stays a
string even when it looks like a number). The model sometimes omits a closing
`</parameter>`; the next `<parameter=` or `</function>` ends the value then. A forced call
is written the same way (xgrammar's `qwen_3_coder` tag, which SGLang uses: `qwen_xml`
arguments).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from undertow.gateway.front.toolparsers.base import (
    ToolCall,
    call_tag,
    calls_format,
    convert_value,
    parameter_schemas,
)
from undertow.gateway.front.toolparsers.tagged import TaggedParser

FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _value_text(text: str) -> str:
    """The value without the one newline the template writes on each side."""
    text = text.removeprefix("\n")
    return text.removesuffix("\n")


class Qwen3CoderParser(TaggedParser):
    @classmethod
    def forced_format(cls, tools: Sequence[dict], parallel: bool) -> dict[str, Any]:
        return calls_format([call_tag(f"<tool_call>\n<function={tool['function']['name']}>\n",
                                      tool, "\n</function>\n</tool_call>", style="qwen_xml")
                             for tool in tools], "\n", parallel)

    def read_block(self, block: str) -> list[ToolCall] | None:
        calls = []
        for match in FUNCTION.finditer(block):
            name = match.group(1).strip()
            schemas = parameter_schemas(self.tools, name)
            arguments = {key.strip(): convert_value(_value_text(value), schemas.get(key.strip()))
                         for key, value in PARAMETER.findall(match.group(2))}
            calls.append(ToolCall(name, arguments))
        if not calls or FUNCTION.sub("", block).strip():
            return None
        return calls
