"""Token truth: a call's prompt token IDs, reusing the session's earlier IDs verbatim so
that no retokenization drift reaches training (`build_prompt`), or, with the `template`
policy, the template's full render. `CallRunner.prompt` calls it; the policies and their
trade-off, as a user sees them: docs/api.md, "Your model's chat template".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from undertow.gateway.engines.protocol import TokenIdsJson
from undertow.gateway.front.token_path import TokenPath
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
    kept (the newest head only), is that path as a `TokenPath`, sharing its chunks with
    the prompts before and after it (so a call reads and copies only what it adds).
    `next_turn_start` is the text of a sampled stop token that begins the next message
    (`Renderer.next_turn_start`).
    `started_s` is when its call started (wall clock; 0 when not known): a session keeps
    its heads in that order, whatever order their calls finished in."""

    call_id: str
    message_keys: tuple[str, ...]
    tools_key: str
    assistant: dict
    leaf: int
    num_prompt_tokens: int
    closing_text: str
    messages: list[dict] | None = None
    token_ids_json: TokenIdsJson | None = None
    token_ids: TokenPath | None = field(default=None, repr=False)
    next_turn_start: str = ""
    started_s: float = 0.0


@dataclass(frozen=True)
class InFlightCall:
    """A chat call of the session that is still generating, as labelling sees it: the
    head it will leave, less what only its end tells (its reply, its leaf). `call_id` is
    its choice 0's; `token_ids` its prompt (never changed: the pool holds it)."""

    call_id: str
    message_keys: tuple[str, ...]
    tools_key: str
    messages: list[dict] | None
    token_ids: Sequence[int] = field(repr=False)
    started_s: float


@dataclass(frozen=True)
class Prompt:
    """The token IDs to send, where they came from and the branch they start (if any).
    `extends_leaf` is the tree leaf whose path is exactly the first `num_reused_tokens`.
    `messages` are the request's messages for the head this call will leave (sharing
    the objects of the head it extended, so a session keeps one copy of its history).
    `token_ids_json` is the JSON array of `token_ids` (None only for raw prompt IDs).
    `token_ids` is a `TokenPath` (a list for raw prompt IDs): nobody changes it."""

    token_ids: TokenPath | list[int]
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
                 policy: str = VERBATIM, in_flight: Sequence[InFlightCall] = ()) -> Prompt:
    """The prompt for `messages`. When they are a head's messages, then its assistant
    message (`same_assistant`), then new ones, it is the head's prompt + completion IDs
    (verbatim) + encode(closing text + rendered suffix): the closing text ends the turn
    as the template would (`<|im_end|>\\n`, less a sampled `<|im_end|>`), the suffix is
    what the template adds for the new messages (None where it does not extend the
    rendered history: then a full render). Messages compare as they are against the
    newest head's, else by canonical keys (`message_key`), so a call costs its new
    messages, not its history. Otherwise the full render, labelled `retry` (the same
    messages again), `rewrite` (earlier history changed) or `subagent` (no shared first
    message, or an older parallel conversation continued). Labels follow what the session
    sent: a call still generating (`in_flight`, oldest first) counts as the head it will
    leave, heads ordered by `started_s`. `path_token_ids(leaf)` reads the tree, for a head
    that did not keep its path's IDs (`_path_of`). With `policy="template"`, the
    template's full render (`_template_prompt`)."""
    if policy == TEMPLATE:
        return _template_prompt(renderer, messages, tools, heads, path_token_ids, in_flight)
    keys = _Keys(messages)
    tkey = tools_key(tools, renderer.template_kwargs)
    newest = _newest(heads, in_flight)
    for head in reversed(heads):
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
        history = _path_of(head, path_token_ids)
        num_reused = len(history)
        token_ids = history.extend(new_ids)
        ids_json = (head.token_ids_json.extend(new_ids)
                    if head.token_ids_json is not None else TokenIdsJson.of(token_ids))
        assert newest is not None, "heads is not empty"
        branch = None if head is newest else _older_head_reason(head, newest)
        if same_history:
            assert head.messages is not None, "same_history says so"
            return Prompt(token_ids, branch, head.call_id, num_reused,
                          keys.after(head.message_keys), tkey, head.leaf,
                          head.messages + messages[num_head:], ids_json)
        return Prompt(token_ids, branch, head.call_id, num_reused, keys.all(), tkey,
                      head.leaf, list(messages), ids_json)
    for earlier in _newest_first(heads, in_flight):
        if earlier.tools_key == tkey and (earlier.messages == messages
                                          or earlier.message_keys == keys.all()):
            reused = (TokenPath.of(earlier.token_ids) if isinstance(earlier, InFlightCall)
                      else _path_of(earlier, path_token_ids).prefix(earlier.num_prompt_tokens))
            return Prompt(reused, RETRY, earlier.call_id, len(reused), earlier.message_keys,
                          tkey, messages=earlier.messages,
                          token_ids_json=TokenIdsJson.of(reused))
    token_ids = TokenPath.of(renderer.encode(renderer.render(messages, tools,
                                                             add_generation_prompt=True)))
    return Prompt(token_ids, _full_render_reason(keys.all(), (*heads, *in_flight)), None, 0,
                  keys.all(), tkey, messages=list(messages),
                  token_ids_json=TokenIdsJson.of(token_ids))


def _template_prompt(renderer: Renderer, messages: list[dict], tools: list[dict] | None,
                     heads: Sequence[Head], path_token_ids: Callable[[int], list[int]],
                     in_flight: Sequence[InFlightCall] = ()) -> Prompt:
    """`token_truth: template`: every call's prompt is the template's full render, so
    training contexts equal what the template shows at inference. A call whose render
    begins with the path of the head it continues extends it (no branch); when the
    template rewrote that history (or its text re-tokenizes differently), the call
    starts a branch labelled `template`, and trains on its own prompt."""
    keys, tkey = _Keys(messages), tools_key(tools, renderer.template_kwargs)
    token_ids = TokenPath.of(renderer.encode(renderer.render(messages, tools,
                                                             add_generation_prompt=True)))
    ids_json = TokenIdsJson.of(token_ids)
    for head in reversed(heads):
        num_head = len(head.message_keys)
        if (tkey != head.tools_key or len(messages) <= num_head + 1
                or keys.all()[:num_head] != head.message_keys
                or not same_assistant(messages[num_head], head.assistant)):
            continue
        path = _path_of(head, path_token_ids)
        if token_ids.prefix(len(path)) == path:
            return Prompt(token_ids, None, head.call_id, len(path), keys.all(), tkey,
                          head.leaf, list(messages), ids_json)
        return Prompt(token_ids, TEMPLATE, None, 0, keys.all(), tkey,
                      messages=list(messages), token_ids_json=ids_json)
    earlier = (*heads, *in_flight)
    retry = any(e.tools_key == tkey and e.message_keys == keys.all() for e in earlier)
    return Prompt(token_ids, RETRY if retry else _full_render_reason(keys.all(), earlier),
                  None, 0, keys.all(), tkey, messages=list(messages), token_ids_json=ids_json)


def _path_of(head: Head, path_token_ids: Callable[[int], list[int]]) -> TokenPath:
    """The IDs of the path to `head.leaf`: the head's own when it kept them (the newest
    head: no read of the tree, no copy), else read from the tree."""
    if head.token_ids is not None:
        return head.token_ids
    return TokenPath.of(path_token_ids(head.leaf))


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


def _newest_first(heads: Sequence[Head], in_flight: Sequence[InFlightCall]
                  ) -> list[Head | InFlightCall]:
    """Heads and calls in flight, the last started first (on a tie, the later head,
    then heads before calls in flight: the order `_newest` picks)."""
    return sorted((*reversed(heads), *reversed(in_flight)), key=lambda e: e.started_s,
                  reverse=True)


def _newest(heads: Sequence[Head], in_flight: Sequence[InFlightCall]
            ) -> Head | InFlightCall | None:
    """The conversation the session started last: its newest head, or a call still in
    flight that started after it (a head wins a tie: its call has just been recorded)."""
    head = heads[-1] if heads else None
    call = in_flight[-1] if in_flight else None
    if call is not None and (head is None or call.started_s > head.started_s):
        return call
    return head


def _older_head_reason(head: Head, newest: Head | InFlightCall) -> str:
    """Continuing an older conversation: a rewrite if the newest one grew out of it,
    otherwise a parallel (sub-agent) conversation."""
    grew_from = newest.message_keys[:len(head.message_keys)] == head.message_keys
    return REWRITE if grew_from else SUBAGENT


def _full_render_reason(keys: tuple[str, ...], earlier: Sequence[Head | InFlightCall]
                        ) -> str | None:
    if not earlier:
        return None
    if keys and all(not e.message_keys or e.message_keys[0] != keys[0] for e in earlier):
        return SUBAGENT
    return REWRITE
