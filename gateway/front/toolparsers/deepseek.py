"""DeepSeek-V3/R1 tool calls in their own tokens, with R1's `<think>` reasoning.

V3 and R1 (each call's type, name, then the arguments in a JSON code fence):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 (name, then the arguments): `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
The whole list is one block; a completion that stops before `<｜tool▁calls▁end｜>` (the
end-of-sentence token comes first in some releases) is read at its end. A forced call may be
written in either release's way (V3's calls joined by a newline, V3.1's by nothing), as
xgrammar's `deepseek_r1` and `deepseek_v3_1` tags write them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from undertow.gateway.front.toolparsers.base import ToolCall, call_tag, calls_format, every_call
from undertow.gateway.front.toolparsers.tagged import TaggedParser

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)(?:" + re.escape(CALL_END) + r"|$)", re.S)
FENCE = re.compile(r"^\s*([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*$", re.S)


def read_call(text: str) -> ToolCall | None:
    """One call between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`."""
    left, sep, right = text.partition(SEP)
    if not sep:
        return None
    fenced = FENCE.match(right) if left.strip() == "function" else None
    name, arguments = (fenced.group(1), fenced.group(2)) if fenced else (left.strip(), right)
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return ToolCall(name, value) if name and isinstance(value, dict) else None


class DeepSeekParser(TaggedParser):
    CALL_OPEN, CALL_CLOSE = CALLS_BEGIN, CALLS_END
    single_call_stop = CALL_END

    @classmethod
    def forced_format(cls, tools: Sequence[dict], parallel: bool) -> dict[str, Any]:
        v3 = [call_tag(f"{CALL_BEGIN}function{SEP}{tool['function']['name']}\n```json\n", tool,
                       f"\n```{CALL_END}") for tool in tools]
        v31 = [call_tag(f"{CALL_BEGIN}{tool['function']['name']}{SEP}", tool, CALL_END)
               for tool in tools]
        return {"type": "or", "elements": [
            {"type": "tag", "begin": CALLS_BEGIN, "end": CALLS_END,
             "content": calls_format(tags, separator, parallel)}
            for tags, separator in ((v3, "\n"), (v31, ""))]}

    def read_block(self, block: str) -> list[ToolCall] | None:
        calls = every_call([read_call(match) for match in CALL.findall(block)])
        if calls is None or CALL.sub("", block).strip():
            return None
        return calls
