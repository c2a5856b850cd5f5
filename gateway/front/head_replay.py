"""Token-truth state across restarts: what each chat call stores of its `Head`, and how
replaying the store rebuilds every session's heads, so that a session's next call after a
restart extends its last call by token truth, as if the gateway had never stopped.
"""

from __future__ import annotations

import bisect
from typing import Any

from undertow.gateway.front.sessions import SessionRegistry
from undertow.gateway.front.tokentruth import Head, Prompt
from undertow.gateway.front.toolparsers import (
    PARSERS,
    Content,
    Event,
    Reasoning,
    ToolCall,
    create_parser,
    replay_parser,
)
from undertow.gateway.render import Renderer
from undertow.gateway.trees.tree import Tree


def assistant_message(text: str, tool_parser: str, parse_tools: bool,
                      tool_call_id, prompt_tail: str = "") -> dict[str, Any]:
    """The assistant message (internal chat form) of a completion's text.
    `tool_call_id()` names each tool call; `prompt_tail`: see `ToolParser`."""
    parser = create_parser(tool_parser, parse_tools=parse_tools, prompt_tail=prompt_tail)
    return message_of_events(parser.feed(text) + parser.finish(), tool_call_id)


def text_before_stop(text: str, stops) -> str:
    """The reply's text as the APIs return it: up to the first stop string (the engine's
    completion, which the tree keeps whole, ends with it). `StopTrimmer` gives the same
    text while streaming."""
    cut = min((i for i in (text.find(stop) for stop in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def message_of_events(events: list[Event], tool_call_id) -> dict[str, Any]:
    """The assistant message of a completion's parsed events (all of them, in order)."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    calls = [e for e in events if isinstance(e, ToolCall)]
    message: dict[str, Any] = {"role": "assistant",
                               "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": tool_call_id(), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments_json}}
            for call in calls]
    return message


def head_record(prompt: Prompt, heads: list[Head], parse_tools: bool) -> dict[str, Any]:
    """What a call stores of its head, as `meta["head"]`: its message keys as a delta
    from the head it extended (all of them when that head is gone or there is none), and
    its tools key; tens of bytes a call, not the history. The rest of a head is in the
    tree: the leaf and prompt length, and the closing text and assistant message,
    re-parsed on replay from the completion exactly as `CallRunner` parsed it (cut at
    the first stop string; tool-call IDs aside, which token truth ignores)."""
    base = next((head for head in reversed(heads) if head.call_id == prompt.extends), None)
    keys = prompt.message_keys
    if base is not None and keys[:len(base.message_keys)] == base.message_keys:
        return {"base": base.call_id, "keys": list(keys[len(base.message_keys):]),
                "tools": prompt.tools_key, "parse_tools": parse_tools}
    return {"base": None, "keys": list(keys), "tools": prompt.tools_key,
            "parse_tools": parse_tools}


class HeadReplay:
    """Rebuilds heads from replayed call events, in store order. Keeps every replayed
    call's message keys until `finish` (a later call may extend any earlier one)."""

    def __init__(self, renderer: Renderer, sessions: SessionRegistry, tool_parser: str):
        self.renderer, self.sessions, self.tool_parser = renderer, sessions, tool_parser
        self._keys: dict[str, tuple[str, ...]] = {}

    def apply(self, event: dict[str, Any], tree: Tree) -> None:
        """`event` is a call record just applied to `tree` (so its call is the last)."""
        stored = (event.get("meta") or {}).get("head")
        session = self.sessions.find(event["session_id"])
        if stored is None or session is None:
            return
        base_keys = self._keys.get(stored["base"], ()) if stored["base"] else ()
        if stored["base"] and stored["base"] not in self._keys:
            return
        keys = base_keys + tuple(stored["keys"])
        self._keys[event["call_id"]] = keys
        call = tree.calls[-1]
        parser = replay_parser(self.tool_parser, event)  # as `CallRunner._parser` chose
        skip_special = not PARSERS[parser].keeps_special_tokens
        token_ids = tree.path_token_ids(call.leaf)
        completion_ids = token_ids[len(token_ids) - call.num_completion_tokens:]
        stops = ((event.get("meta") or {}).get("sampling") or {}).get("stop") or ()
        text = text_before_stop(self.renderer.decode(completion_ids, skip_special), stops)
        num_prompt = len(token_ids) - len(completion_ids)
        tail = self.renderer.decode(token_ids[max(0, num_prompt - 8):num_prompt], False)
        message = assistant_message(text, parser, stored["parse_tools"],
                                    lambda: "call_restored", tail)
        started_s = ((event.get("meta") or {}).get("timings") or {}).get("start_s") or 0.0
        head = Head(event["call_id"], keys, stored["tools"], message, call.leaf,
                    len(token_ids) - len(completion_ids),
                    self.renderer.closing_text(completion_ids),
                    next_turn_start=self.renderer.next_turn_start(completion_ids),
                    started_s=started_s)
        if event.get("branch") == "sample" and session.heads:
            # choice i > 0 of the call whose choice 0 was just replayed: the live gateway
            # left choice 0's head after its other choices' (`CallRecorder.record`), and
            # so does replay, just before it (the last head that started when it did)
            after = bisect.bisect_right(session.heads, started_s, key=lambda h: h.started_s)
            session.heads.insert(max(after - 1, 0), head)
            del session.heads[:-self.sessions.num_heads]
        else:
            session.add_head(head, self.sessions.num_heads)
            session.num_calls += 1

    def finish(self) -> None:
        self._keys.clear()
