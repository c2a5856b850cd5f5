"""GLM-4.5's tool calls, the name then key/value tags, values written as text:

    <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>

The template writes string values as they are and other values as JSON; values are
read back by the tool's parameter schema.
"""

from __future__ import annotations

import re

from undertow.gateway.front.toolparsers.base import ToolCall, convert_value, parameter_schemas
from undertow.gateway.front.toolparsers.tagged import TaggedParser

PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45Parser(TaggedParser):
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
