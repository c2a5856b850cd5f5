"""Token truth: the prompt token IDs of a call, reusing a session's earlier IDs verbatim.

A session remembers a few `Head`s: for each recent call, the messages it was sent,
the assistant message the gateway returned, and the tree leaf that ends its prompt
and completion IDs. When a new request's messages are one head's messages, then that
head's assistant message, then new messages, the prompt is

    head's prompt + completion IDs (verbatim) + encode(closing text + rendered suffix)

where the closing text ends the assistant turn the way the template would (e.g.
`<|im_end|>\\n`, minus a sampled `<|im_end|>`), and the rendered suffix is the text the
template adds for the new messages (it must extend the rendered history, which holds
for templates that never rewrite earlier turns; otherwise we render in full). The
history is never re-tokenized, so no retokenization drift can reach training.

Messages are compared in a canonical form, not as text, so that scaffolds that
re-send history with re-serialized tool arguments, dropped tool-call IDs, dropped
reasoning or whitespace-stripped content still extend their session. The newest
head also keeps the request's messages themselves: a scaffold that re-sends its
history unchanged (the usual case) is recognised by comparing the messages as they
are (list and string equality in C, tens of microseconds for hundreds of messages),
and only the new messages get canonical keys; any difference falls back to the
canonical keys of the whole request. So the cost of a call follows its new messages,
not its history.

Otherwise the prompt is rendered in full and labelled with why the session branched:
`retry` (the same messages again), `rewrite` (earlier history changed, e.g. context
condensation), `subagent` (a conversation that shares no first message with the
session's earlier ones, or that continues an older parallel conversation).

That is the `verbatim` policy, the default. The `template` policy renders every call in
full instead, as the template shows it at inference, and labels a call whose render
departs from the path it continues `template` (see `_template_prompt` and the README).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from undertow.gateway.engines.protocol import TokenIdsJson
from undertow.gateway.render import Renderer

RETRY, REWRITE, SUBAGENT, TEMPLATE = "retry", "rewrite", "subagent", "template"
# Policies (`GatewayConfig.token_truth`): `verbatim` reuses the sampled IDs (above);
# `template` sends the template's own full render every call (`_template_prompt`).
VERBATIM = "verbatim"
TOKEN_TRUTH_POLICIES = (VERBATIM, TEMPLATE)


@dataclass(frozen=True)
class Head:
    """A conversation state a session may extend: the request's canonical message keys,
    its tools' key, the returned assistant message (internal chat form), and the
    tree leaf ending that call's prompt + completion (its IDs are read from the tree).
    `messages`, when kept (the newest heads only, see `Session.add_head`), are the
    request's messages in internal chat form, one per key; never mutated.
    `token_ids_json`, when kept (the newest head only), is the JSON array of the IDs of
    the path to `leaf` (that call's prompt and completion), in pieces; `token_ids`, when
    kept (the newest head only, until a prompt takes it over), is that path as a list the
    head owns: no one else holds or mutates it. `next_turn_start` is the text of a
    sampled stop token that begins the next message (`Renderer.next_turn_start`)."""

    call_id: str
    message_keys: tuple[str, ...]
    tools_key: str
    assistant: dict
    leaf: int
    num_prompt_tokens: int
    closing_text: str
    messages: list[dict] | None = None
    token_ids_json: TokenIdsJson | None = None
    token_ids: list[int] | None = field(default=None, repr=False)
    next_turn_start: str = ""


@dataclass(frozen=True)
class Prompt:
    """The token IDs to send, where they came from and the branch they start (if any).
    `extends_leaf` is the tree leaf whose path is exactly the first `num_reused_tokens`.
    `messages` are the request's messages for the head this call will leave (sharing
    the objects of the head it extended, so a session keeps one copy of its history).
    `token_ids_json` is the JSON array of `token_ids` (None only for raw prompt IDs)."""

    token_ids: list[int]
    branch: str | None
    extends: str | None
    num_reused_tokens: int
    message_keys: tuple[str, ...]
    tools_key: str
    extends_leaf: int | None = None
    messages: list[dict] | None = None
    token_ids_json: TokenIdsJson | None = None

    @property
    def token_truth(self) -> bool:
        return self.extends is not None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part)
                       for part in content)
    return str(content)


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value.strip()
    return value


def _tool_calls(message: dict) -> list:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        calls.append([function.get("name"), _arguments(function.get("arguments"))])
    return calls


def message_key(message: dict) -> str:
    """The canonical form of a message, as a short digest: role, stripped text, tool
    calls as (name, parsed arguments); IDs of tool calls are left out, and so is
    reasoning: scaffolds re-send earlier assistant turns with their reasoning or without
    it (Codex and Claude Code strip it, some clients only from older turns), and token
    truth reuses the sampled reasoning's IDs either way. Digests keep comparing (and
    storing) a long history cheap. (The text is length-prefixed and JSON escapes NUL,
    so distinct forms never join to the same bytes.)"""
    text = _text(message.get("content")).strip()
    calls = _tool_calls(message) if message.get("tool_calls") else None
    calls_json = json.dumps(calls, sort_keys=True, ensure_ascii=False) if calls else ""
    return _digest(f"{message.get('role')}\0{len(text)}\0{text}\0{calls_json}")


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def tools_key(tools: Sequence[dict] | None, template_kwargs: dict | None = None) -> str:
    """The digest of what a request gives the template besides its messages: its tools,
    and its template arguments (a call with other arguments is no retry of this one)."""
    if not tools and not template_kwargs:
        return _NO_TOOLS_KEY
    given = [list(tools or []), template_kwargs] if template_kwargs else list(tools or [])
    return _digest(json.dumps(given, sort_keys=True, ensure_ascii=False))


_NO_TOOLS_KEY = _digest(json.dumps([]))  # `tools_key` of a call without either


def same_assistant(sent: dict, returned: dict) -> bool:
    """Whether a message the scaffold sends back is the assistant message we returned.
    A scaffold may drop the reasoning we returned; it may not change anything else."""
    if sent.get("role") != "assistant":
        return False
    if _text(sent.get("content")).strip() != _text(returned.get("content")).strip():
        return False
    if _tool_calls(sent) != _tool_calls(returned):
        return False
    reasoning = _text(sent.get("reasoning_content")).strip()
    return not reasoning or reasoning == _text(returned.get("reasoning_content")).strip()


def build_prompt(renderer: Renderer, messages: list[dict], tools: list[dict] | None,
                 heads: Sequence[Head], path_token_ids: Callable[[int], list[int]],
                 policy: str = VERBATIM) -> Prompt:
    """The prompt for `messages`, by token truth from the newest head it extends,
    else rendered in full with a branch reason. `path_token_ids(leaf)` reads the tree
    into a list the prompt then owns (and extends). With `policy="template"`, the
    template's full render (`_template_prompt`)."""
    if policy == TEMPLATE:
        return _template_prompt(renderer, messages, tools, heads, path_token_ids)
    keys = _Keys(messages)
    tkey = tools_key(tools, renderer.template_kwargs)
    for position, head in enumerate(reversed(heads)):
        num_head = len(head.message_keys)
        if tkey != head.tools_key or len(messages) <= num_head + 1:
            continue
        same_history = (head.messages is not None
                        and messages[:num_head] == head.messages)  # equal -> same keys
        if ((not same_history and keys.all()[:num_head] != head.message_keys)
                or not same_assistant(messages[num_head], head.assistant)):
            continue
        suffix = renderer.render_suffix(messages, num_head + 1, tools)
        if suffix is None:
            break
        if head.next_turn_start and suffix.startswith(head.next_turn_start):
            suffix = suffix[len(head.next_turn_start):]  # sampled already
        new_ids = renderer.encode(head.closing_text + suffix)
        token_ids = path_token_ids(head.leaf)
        num_reused = len(token_ids)
        token_ids += new_ids
        ids_json = (head.token_ids_json.extend(new_ids)
                    if head.token_ids_json is not None else TokenIdsJson.of(token_ids))
        branch = None if position == 0 else _older_head_reason(head, heads[-1])
        if same_history:
            return Prompt(token_ids, branch, head.call_id, num_reused,
                          keys.after(head.message_keys), tkey, head.leaf,
                          head.messages + messages[num_head:], ids_json)
        return Prompt(token_ids, branch, head.call_id, num_reused, keys.all(), tkey,
                      head.leaf, list(messages), ids_json)
    for head in reversed(heads):
        if head.tools_key == tkey and (head.messages == messages
                                       or head.message_keys == keys.all()):
            reused = path_token_ids(head.leaf)[:head.num_prompt_tokens]
            return Prompt(reused, RETRY, head.call_id, len(reused), head.message_keys, tkey,
                          messages=head.messages, token_ids_json=TokenIdsJson.of(reused))
    token_ids = renderer.encode(renderer.render(messages, tools, add_generation_prompt=True))
    return Prompt(token_ids, _full_render_reason(keys.all(), heads), None, 0, keys.all(), tkey,
                  messages=list(messages), token_ids_json=TokenIdsJson.of(token_ids))


def _template_prompt(renderer: Renderer, messages: list[dict], tools: list[dict] | None,
                     heads: Sequence[Head], path_token_ids: Callable[[int], list[int]]
                     ) -> Prompt:
    """`token_truth: template`: every call's prompt is the template's full render, so
    training contexts equal what the template shows at inference. A call whose render
    begins with the path of the head it continues extends it (no branch); when the
    template rewrote that history (or its text re-tokenizes differently), the call
    starts a branch labelled `template`, and trains on its own prompt."""
    keys, tkey = _Keys(messages), tools_key(tools, renderer.template_kwargs)
    token_ids = renderer.encode(renderer.render(messages, tools, add_generation_prompt=True))
    ids_json = TokenIdsJson.of(token_ids)
    for head in reversed(heads):
        num_head = len(head.message_keys)
        if (tkey != head.tools_key or len(messages) <= num_head + 1
                or keys.all()[:num_head] != head.message_keys
                or not same_assistant(messages[num_head], head.assistant)):
            continue
        path = path_token_ids(head.leaf)
        if token_ids[:len(path)] == path:
            return Prompt(token_ids, None, head.call_id, len(path), keys.all(), tkey,
                          head.leaf, list(messages), ids_json)
        return Prompt(token_ids, TEMPLATE, None, 0, keys.all(), tkey,
                      messages=list(messages), token_ids_json=ids_json)
    retry = any(head.tools_key == tkey and head.message_keys == keys.all() for head in heads)
    return Prompt(token_ids, RETRY if retry else _full_render_reason(keys.all(), heads), None,
                  0, keys.all(), tkey, messages=list(messages), token_ids_json=ids_json)


class _Keys:
    """The canonical keys of a request's messages, computed only when needed: all of
    them (`all`), or only those after a history already known to be equal (`after`)."""

    def __init__(self, messages: list[dict]):
        self.messages = messages
        self._all: tuple[str, ...] | None = None

    def all(self) -> tuple[str, ...]:
        if self._all is None:
            self._all = tuple(message_key(message) for message in self.messages)
        return self._all

    def after(self, history_keys: tuple[str, ...]) -> tuple[str, ...]:
        if self._all is None:
            self._all = history_keys + tuple(message_key(message)
                                             for message in self.messages[len(history_keys):])
        return self._all


def _older_head_reason(head: Head, newest: Head) -> str:
    """Continuing an older conversation: a rewrite if the newest one grew out of it,
    otherwise a parallel (sub-agent) conversation."""
    grew_from = newest.message_keys[:len(head.message_keys)] == head.message_keys
    return REWRITE if grew_from else SUBAGENT


def _full_render_reason(keys: tuple[str, ...], heads: Sequence[Head]) -> str | None:
    if not heads:
        return None
    if keys and all(not head.message_keys or head.message_keys[0] != keys[0] for head in heads):
        return SUBAGENT
    return REWRITE
