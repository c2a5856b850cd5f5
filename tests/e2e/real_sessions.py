"""Independent checks of a real scaffold session's capture (test_real_model_agents.py).

Three records of one session are compared, none of them the gateway's own reply:
- the engine's: what `EngineRecorder` saw the engine get and send back;
- the scaffold's: each model call's body as the scaffold sent it (`ScaffoldRecorder`);
- the tree the gateway captured.

`assert_token_truth` checks that every call is labelled as extending its session (no
`rewrite`, no branch), that each call's captured prompt and completion are the engine's
own, and that each later prompt is the previous prompt + the IDs the engine returned +
the new messages' rendering, where that rendering is computed here with transformers'
`apply_chat_template` on the model's own template and tokenized with its own tokenizer.

The new messages of a call are those after its last assistant item (the tool results, and
any user text), read from the scaffold's request in its own API (`chat_messages`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence

from tests.e2e.engine_recorder import Generation
from tests.gateway.capture import captured
from undertow.gateway.trees.tree import Tree

ASSISTANT_ITEMS = ("function_call", "reasoning")  # Responses items the model wrote
MARK = "\x00MARK\x00"


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or ()
                   if isinstance(part, dict) and part.get("type") in ("text", "input_text",
                                                                      "output_text"))


def _new_chat(messages: list[dict]) -> list[dict]:
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return [{"role": m["role"], "content": _text(m.get("content"))}
            for m in messages[last + 1:]]


def _new_responses(items: list[dict]) -> list[dict]:
    last = max(i for i, item in enumerate(items) if item.get("type") in ASSISTANT_ITEMS
               or item.get("role") == "assistant")
    new = []
    for item in items[last + 1:]:
        if item.get("type") == "function_call_output":
            output = item["output"]
            new.append({"role": "tool", "content": output if isinstance(output, str)
                        else _text(output)})
        elif item.get("type", "message") == "message":
            new.append({"role": item["role"], "content": _text(item.get("content"))})
    return new


def _new_anthropic(messages: list[dict]) -> list[dict]:
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    new = []
    for message in messages[last + 1:]:
        blocks = message["content"]
        if isinstance(blocks, str):
            new.append({"role": message["role"], "content": blocks})
            continue
        for block in blocks:
            if block["type"] == "tool_result":
                new.append({"role": "tool", "content": _text(block.get("content"))})
        text = _text([b for b in blocks if b["type"] == "text"])
        if text:
            new.append({"role": message["role"], "content": text})
    return new


NEW_MESSAGES = {"chat": _new_chat, "responses": _new_responses, "anthropic": _new_anthropic}


def new_messages(api: str, body: dict) -> list[dict]:
    """The chat messages a model call in `api` adds after its last assistant item."""
    return NEW_MESSAGES[api](body["input"] if api == "responses" else body["messages"])


def expected_suffix(tokenizer, new: Sequence[dict], completion_ids: Sequence[int]) -> str:
    """The text after a sampled completion that the template writes: the rest of the
    assistant turn's end (what the sampled stop token did not already write), then the
    new messages and the generation prompt. Rendered after a one-turn history: the
    rendering of what follows an assistant turn does not depend on the turns before it
    in this template (each turn is rendered on its own)."""
    history = [{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}]
    closed = tokenizer.apply_chat_template(history, tokenize=False)
    turn_end = closed[closed.index(MARK) + len(MARK):]
    sampled = tokenizer.decode(list(completion_ids), skip_special_tokens=False)
    stop_text = tokenizer.decode(list(completion_ids[-1:]), skip_special_tokens=False)
    rest = turn_end[len(stop_text):] if turn_end.startswith(stop_text) and \
        sampled.endswith(stop_text) else turn_end
    full = tokenizer.apply_chat_template([*history, *new], tokenize=False,
                                         add_generation_prompt=True)
    assert full.startswith(closed), "the template rewrote the history it was given"
    return rest + full[len(closed):]


def assert_token_truth(tree: Tree, session_id: str, generations: list[Generation],
                       api: str, scaffold_calls: list[dict], tokenizer) -> None:
    """See the module docstring. `generations` and `scaffold_calls` are in call order (one
    scaffold session, one call at a time)."""
    calls = [call for call in tree.calls if call.session_id == session_id]
    assert len(calls) >= 2, f"the session made {len(calls)} call(s); token truth needs two"
    assert len(generations) == len(calls) == len(scaffold_calls), (
        len(generations), len(calls), len(scaffold_calls))
    assert [call.branch for call in calls] == [None] * len(calls), [c.branch for c in calls]
    for call, generation in zip(calls, generations, strict=True):
        record = captured(tree, call.call_id)
        assert record.prompt_ids == generation.input_ids, call.call_id
        assert record.completion_ids == generation.output_ids, call.call_id
    for index, (before, after) in enumerate(itertools.pairwise(generations)):
        assert captured(tree, calls[index + 1].call_id).meta["token_truth"]
        history = before.input_ids + before.output_ids
        assert after.input_ids[:len(history)] == history, f"call {index + 1}"
        suffix_ids = after.input_ids[len(history):]
        new = new_messages(api, scaffold_calls[index + 1])
        text = expected_suffix(tokenizer, new, before.output_ids)
        assert tokenizer.decode(suffix_ids, skip_special_tokens=False) == text, (
            f"call {index + 1}", json.dumps(new)[:2000])
        assert suffix_ids == tokenizer.encode(text, add_special_tokens=False), f"call {index + 1}"
