"""The protocol of tool-call parsers, and the events they emit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call; `arguments` is the parsed JSON object."""

    name: str
    arguments: Any

    @property
    def arguments_json(self) -> str:
        import json

        return json.dumps(self.arguments, ensure_ascii=False)


Event = Content | Reasoning | ToolCall


class ToolParser(Protocol):
    """Stateful parser of one completion. `feed` takes new text and returns the events
    it completes; `finish` flushes at the end of the completion. Concatenating all
    Content texts gives the message's content, all Reasoning texts its reasoning."""

    def __init__(self, parse_tools: bool = True) -> None: ...

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...
