"""Chat templates and token IDs of a model directory: `Renderer` renders its template
with jinja2 and codes text with `tokenizers` (never `transformers`, which would import torch
into the gateway); `Detokenizer` turns sampled IDs into text deltas. Which earlier IDs a
prompt reuses (token truth) is `front/tokentruth.py`'s; docs/design.md, "From a scaffold's
HTTP call to the tree".
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

import jinja2
from jinja2 import meta
from tokenizers import Tokenizer

from undertow.gateway.errors import BadRequest
from undertow.gateway.trees.template_env import (
    chat_template_environment,
    read_chat_templates,
    special_token_text,
)

_MARK = "\u2063UNDERTOW_MARK\u2063"


def encode_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The token IDs of `text`, no special tokens added. `encode_batch_fast` (tokenizers
    0.20) is `encode` less the character offsets, which the gateway never reads: a
    1,800-token tool result took 1.3-1.5 ms of CPU instead of 2.2 ms. With one text the
    batch is encoded in the calling thread."""
    return tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids


class TemplateError(BadRequest):
    """The messages cannot be rendered by the model's chat template."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(f"the chat template refused the messages: {message}")


def _content_text(content) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _with_argument_objects(messages: Sequence[Mapping]) -> list:
    """The messages with each tool call's JSON arguments string given to the template as
    the object it encodes, as vLLM and SGLang give them: stock templates (Llama 3.x,
    Qwen3-Coder, GLM-4.5, gpt-oss) iterate or `tojson` the arguments as a mapping. Only
    messages with tool calls are copied."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if calls:
            message = {**message, "tool_calls": [_call_with_object(call) for call in calls]}
        out.append(message)
    return out


def _call_with_object(call: Mapping) -> Mapping:
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class Renderer:
    """The chat template, tokenizer and stop tokens of one model directory.

    Invariant: `encode(decode(ids)) == ids` is NOT assumed anywhere; sampled IDs are
    only ever reused verbatim (token truth), never recovered from text."""

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(f"{tokenizer_file} is missing; pass a Hugging Face model "
                                    "directory (undertow model init --out DIR builds one)")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config_file = model_dir / "tokenizer_config.json"
        config = (json.loads(config_file.read_text(encoding="utf-8"))
                  if config_file.exists() else {})
        templates = read_chat_templates(model_dir)
        default, with_tools = templates.select(with_tools=False), templates.select(with_tools=True)
        if default is None or with_tools is None:  # with tools falls back to the default
            raise FileNotFoundError(
                f"{model_dir} has no default chat template (read {templates.source}); put the "
                "model's template in chat_template.jinja")
        environment = chat_template_environment(_raise_exception)
        self._default = environment.from_string(default)
        self._with_tools = environment.from_string(with_tools)
        # The names the templates read besides their own (a request's template argument
        # that none of them takes would change nothing: see `reads`).
        self._variables = frozenset().union(*(
            meta.find_undeclared_variables(environment.parse(text))
            for text in templates.by_name.values()))
        self._special = {name: special_token_text(config.get(name))
                         for name in ("bos_token", "eos_token")}
        self._kwargs: dict = {}
        self.max_length = int(config.get("model_max_length") or 0)
        self.stop_token_ids = self._read_stop_token_ids(model_dir, config)
        self._stop_texts = {token_id: self.decode([token_id], skip_special_tokens=False)
                            for token_id in self.stop_token_ids}
        self.turn_end = self._probe_turn_end()
        # What `closing_text` drops when another stop token stands in for the turn end:
        # constant per template, so found once (encoding it took ~0.1 ms of every call).
        self._turn_end_special = self._leading_special_token(self.turn_end)
        self.suffix_is_local = self._probe_local_suffix()

    def _read_stop_token_ids(self, model_dir: Path, config: dict) -> frozenset[int]:
        ids: set[int] = set()
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and (eos_id := self.tokenizer.token_to_id(eos)) is not None:
            ids.add(eos_id)
        generation = model_dir / "generation_config.json"
        if generation.exists():
            value = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value] if value is not None else [])
        return frozenset(ids)

    def _probe_turn_end(self) -> str:
        """The text the template writes after an assistant message's content (e.g.
        `<|im_end|>\\n`): what closes a turn whose completion the engine cut."""
        text = self.render([{"role": "user", "content": "u"},
                            {"role": "assistant", "content": _MARK}])
        return text[text.rindex(_MARK) + len(_MARK):]

    def render_suffix(self, messages: Sequence[Mapping], num_history: int,
                      tools: Sequence[Mapping] | None = None) -> str | None:
        """The text the template adds after `messages[:num_history]` for the rest and
        the generation prompt, or None when it rewrites the history's text.

        With a template whose turns render locally (`suffix_is_local`), only a window is
        rendered: the first message when it is a system message, the turn before the
        history's last, that last turn, and the new messages. So the cost of a call
        follows its new messages, not its history."""
        start = 0
        if self.suffix_is_local:
            start = max(0, num_history - 2)
        if start > 0 and messages[0].get("role") == "system":
            window = [messages[0], *messages[max(1, start):]]
            num_history = num_history - max(1, start) + 1
        else:
            window = list(messages[start:])
            num_history -= start
        history = self.render(window[:num_history], tools)
        full = self.render(window, tools, add_generation_prompt=True)
        if full.startswith(history):
            return full[len(history):]
        return self._suffix_after_rewrite(window, num_history, tools)

    def _suffix_after_rewrite(self, window: list, num_history: int,
                              tools: Sequence[Mapping] | None) -> str | None:
        """The suffix for a template that rewrites earlier turns once more messages
        follow (Qwen3, DeepSeek-R1, GLM-4.5 and gpt-oss drop the reasoning of earlier
        assistant turns): what it writes after the history's last turn, an assistant
        message, in the full render. A marker at the end of that message's content
        finds the turn: the suffix is the text after the marker, less what the template
        writes after the content when the turn is the last (its tool calls, its turn
        end). None when the marker does not show (the template drops such content) or
        the turn's end is written differently once messages follow, unless only its end
        token differs (`_after_swapped_turn_end`)."""
        last = window[num_history - 1]
        if last.get("role") != "assistant":
            return None
        marked = [*window[:num_history - 1],
                  {**last, "content": _content_text(last.get("content")) + _MARK}]
        alone = self.render(marked, tools)
        full = self.render([*marked, *window[num_history:]], tools, add_generation_prompt=True)
        if alone.count(_MARK) != 1 or full.count(_MARK) != 1:
            return None
        after = alone[alone.index(_MARK) + len(_MARK):]
        tail = full[full.index(_MARK) + len(_MARK):]
        if tail.startswith(after):
            return tail[len(after):]
        return self._after_swapped_turn_end(after, tail)

    def _after_swapped_turn_end(self, after: str, tail: str) -> str | None:
        """The suffix when the last turn ends with one special token (gpt-oss writes
        `<|return|>`, the token its model samples, in a render that ends there) and the
        same turn ends with another once messages follow (`<|end|>`): the text after that
        other token. Token truth keeps the sampled token where the template writes the
        other (as `closing_text` does for `<|call|>`); None for any other difference."""
        if not after or self._leading_special_token(after) != after:
            return None
        swapped = self._leading_special_token(tail)
        return tail[len(swapped):] if swapped else None

    def _probe_local_suffix(self) -> bool:
        """Whether rendering a window gives the same suffix as rendering everything, on
        conversations that exercise what templates look back at (system prompts, tools,
        tool results after tool calls, reasoning, repeated turns). Templates that look
        further back (e.g. at the last user turn for reasoning) fail here and are then
        always rendered in full: slower, never wrong."""
        call = {"id": "c", "type": "function",
                "function": {"name": "f", "arguments": '{"x": 1}'}}
        turns = [{"role": "user", "content": "u1"},
                 {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                 {"role": "user", "content": "u2"},
                 {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c", "content": "t1"},
                 {"role": "tool", "tool_call_id": "c", "content": "t2"},
                 {"role": "assistant", "content": "a2", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c", "content": "t3"},
                 {"role": "assistant", "content": "a3"},
                 {"role": "user", "content": "u3"},
                 {"role": "assistant", "content": "a4"},
                 {"role": "user", "content": "u4"}]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        self.suffix_is_local = False
        try:
            for messages in (turns, [{"role": "system", "content": "s"}, *turns]):
                for tool_list in (None, tools):
                    for num_history, message in enumerate(messages, start=1):
                        if message["role"] != "assistant":
                            continue
                        everything = self.render_suffix(messages, num_history, tool_list)
                        self.suffix_is_local = True
                        window = self.render_suffix(messages, num_history, tool_list)
                        self.suffix_is_local = False
                        if window != everything:
                            return False
        except TemplateError:
            return False
        return True

    @property
    def template_kwargs(self) -> dict:
        """The arguments this renderer passes to the template besides the messages."""
        return self._kwargs

    def reads(self, name: str) -> bool:
        """Whether the template reads the variable `name` (e.g. `reasoning_effort`)."""
        return name in self._variables

    def with_kwargs(self, kwargs: Mapping | None) -> Renderer:
        """This renderer, passing `kwargs` to the template as well (a request's
        `chat_template_kwargs` such as `enable_thinking`, and `reasoning_effort`)."""
        if not kwargs:
            return self
        bound = copy.copy(self)
        bound._kwargs = {**self._kwargs, **kwargs}
        return bound

    def render(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
               add_generation_prompt: bool = False) -> str:
        given = _with_argument_objects(messages)
        try:
            template = self._with_tools if tools else self._default
            return template.render(messages=given,
                                         tools=list(tools) if tools else None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self._special, **self._kwargs)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError,
                AttributeError) as error:
            # A template's own Python errors too: gpt-oss's tests `"..." in message.content`
            # and fails with TypeError on an assistant message whose content is null.
            raise TemplateError(f"the chat template failed on these messages: "
                                f"{type(error).__name__}: {error}") from error

    def encode(self, text: str) -> list[int]:
        return encode_ids(self.tokenizer, text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id) or ""

    def closing_text(self, completion_ids: Sequence[int]) -> str:
        """Text to append after a completion to close the assistant turn: the turn end,
        less the part its last sampled token already wrote (a sampled `<|im_end|>` is the
        start of `<|im_end|>\n`). A sampled stop token that is another end of turn stands
        in for the turn end's first special token (gpt-oss samples `<|return|>` or
        `<|call|>` where its history writes `<|end|>`)."""
        last = self.sampled_stop_text(completion_ids)
        if last and self.turn_end.startswith(last):
            return self.turn_end[len(last):]
        if last and self._turn_end_special:
            return self.turn_end[len(self._turn_end_special):]
        return self.turn_end

    def next_turn_start(self, completion_ids: Sequence[int]) -> str:
        """The text of a sampled stop token that begins the next message rather than
        ending this one (GLM-4.5 writes no turn end and stops at `<|user|>` or
        `<|observation|>`): the suffix for the next messages begins with it, so token
        truth leaves it out there, where the sampled token already stands."""
        last = self.sampled_stop_text(completion_ids)
        return last if last and not self.turn_end else ""

    @property
    def eos_text(self) -> str:
        """The EOS token's text as `tokenizer_config.json` names it ("" when it does not)."""
        return self._special.get("eos_token") or ""

    def sampled_stop_text(self, completion_ids: Sequence[int]) -> str:
        """The text of the completion's last token when it is a stop token, else ""."""
        if completion_ids:
            return self._stop_texts.get(completion_ids[-1], "")
        return ""

    def _leading_special_token(self, text: str) -> str:
        token_ids = self.encode(text)
        if not token_ids:
            return ""
        added = self.tokenizer.get_added_tokens_decoder().get(token_ids[0])
        return added.content if added is not None and added.special else ""


class Detokenizer:
    """Incremental decoding of one completion. `push(ids)` returns the new text, holding
    back a trailing partial UTF-8 character until its last byte arrives.

    Only a window of recent IDs is decoded at each step (vLLM's scheme), so the cost
    per token does not grow with the completion's length."""

    def __init__(self, renderer: Renderer, skip_special_tokens: bool = True):
        self._renderer = renderer
        self._skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def push(self, token_ids: Sequence[int]) -> str:
        self.token_ids.extend(token_ids)
        decode, skip = self._renderer.decode, self._skip_special
        prefix_text = (decode(self.token_ids[self._prefix_offset:self._read_offset], skip)
                       if self._read_offset > self._prefix_offset else "")
        window_text = decode(self.token_ids[self._prefix_offset:], skip)
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        delta = window_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever was held back (a trailing partial character), at the end."""
        full = self._renderer.decode(self.token_ids, self._skip_special)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta
