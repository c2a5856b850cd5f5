"""GLM-4.5's tool calls, the name then key/value tags, values written as text:

    <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>

The template writes string values as they are and other values as JSON; values are
read back by the tool's parameter schema. GLM-4.7 writes the same without the newlines; a
forced call may be written either way (xgrammar's `glm_xml` arguments, as its `glm_4_7`
tag, which SGLang uses).
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

PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45Parser(TaggedParser):
    @classmethod
    def forced_format(cls, tools: Sequence[dict], parallel: bool) -> dict[str, Any]:
        tags = [call_tag(f"<tool_call>{tool['function']['name']}", tool, "</tool_call>",
                         style="glm_xml") for tool in tools]
        return {"type": "or", "elements": [calls_format(tags, separator, parallel)
                                           for separator in ("\n", "")]}

    def read_block(self, block: str) -> list[ToolCall] | None:
        head, _, rest = block.partition("<arg_key>")
        name = head.strip()
        if not name or "<" in name or "\n" in name:
            return None
        rest = "<arg_key>" + rest if rest else ""
        if PAIR.sub("", rest).strip():
            return None
        schemas = parameter_schemas(self.tools, name)
        arguments = {key.strip(): convert_value(value, schemas.get(key.strip()))
                     for key, value in PAIR.findall(rest)}
        return [ToolCall(name, arguments)]
