"""`undertow model check DIR`: whether token truth holds with a model directory's own chat
template and tokenizer, before any GPU hour is spent; no engine runs. What it plays and
reports, as a user reads it: docs/api.md, "Your model's chat template".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undertow.gateway.front.calls import model_vocab_size
from undertow.gateway.front.head_replay import message_of_events
from undertow.gateway.front.sessions import Session
from undertow.gateway.front.tokentruth import Head, build_prompt
from undertow.gateway.front.toolparsers import PARSERS, create_parser, resolve_parser
from undertow.gateway.front.toolparsers.detect import template_of
from undertow.gateway.render import Renderer, TemplateError
from undertow.gateway.trees.tree import Tree

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]


@dataclass
class SessionResult:
    """One played session: how many later calls kept token truth, and the first that
    did not (turn and why)."""

    name: str
    num_calls: int = 0
    num_extended: int = 0
    num_tool_calls_lost: int = 0
    first_failure: str | None = None

    @property
    def holds(self) -> bool:
        return self.num_calls > 0 and self.num_extended == self.num_calls - 1


@dataclass
class ModelCheck:
    model_dir: Path
    parser: str
    reasoning: str
    stop_tokens: list[tuple[int, str]]
    writes_tool_calls: bool = True
    num_tokenizer_ids: int = 0
    vocab_size: int | None = None  # rows of the model's embedding (config.json)
    sessions: list[SessionResult] = field(default_factory=list)
    error: str | None = None

    @property
    def holds(self) -> bool:
        return self.error is None and all(result.holds for result in self.sessions)

    def report(self) -> str:
        stops = ", ".join(f"{token_id} {text!r}" for token_id, text in self.stop_tokens)
        lines = [f"model: {self.model_dir}",
                 f"tool-call parser: {self.parser} (tool_parser=auto, the default, picks it)",
                 f"reasoning: {self.reasoning}",
                 f"stop/EOS IDs: {stops or 'none'}"]
        if self.vocab_size is not None:
            lines.append(f"vocabulary: the tokenizer's {self.num_tokenizer_ids} IDs, the "
                         f"model's embedding {self.vocab_size} rows (config.json vocab_size)")
        if not self.writes_tool_calls:
            lines.append("tool calls: the template writes none (it renders an assistant "
                         "turn's tool calls as nothing), so no parser can read them back")
        if self.error:
            lines.append(f"token truth: could not be checked: {self.error}")
        for result in self.sessions:
            verdict = "holds" if result.holds else "FAILS"
            line = (f"token truth, history {result.name}: {verdict} "
                    f"({result.num_extended} of {result.num_calls - 1} later calls extend the "
                    "previous prompt + sampled IDs)")
            if result.first_failure:
                line += f"; first failure: {result.first_failure}"
            lines.append(line)
        lines += [f"set: {advice}" for advice in self.advice()]
        lines.append("verdict: " + ("token truth holds" if self.holds else "token truth does "
                                    "NOT hold; see 'set' above"))
        return "\n".join(lines)

    def advice(self) -> list[str]:
        advice = []
        if not self.stop_tokens:
            advice.append("eos_token_id in generation_config.json (or eos_token in "
                          "tokenizer_config.json): the engine has no stop token")
        if not self.writes_tool_calls:
            advice.append("nothing for tool calls, the template has no format for them: "
                          "use a scaffold whose actions are text (mini-swe-agent's bash "
                          "blocks) or a model whose template writes tool calls")
        elif any(result.num_tool_calls_lost for result in self.sessions):
            advice.append(f"tool_parser=NAME: the template's tool calls do not parse with "
                          f"{self.parser!r} (choose one of {sorted(PARSERS)})")
        if self.vocab_size is not None and self.num_tokenizer_ids > self.vocab_size:
            advice.append(f"a model whose embedding holds every tokenizer ID (vocab_size >= "
                          f"{self.num_tokenizer_ids}): the gateway refuses any prompt with "
                          f"an ID >= {self.vocab_size} (text the tokenizer writes with one "
                          "included), as no engine could embed it")
        if not self.holds:
            advice.append("token_truth: template (each call then trains on the template's "
                          "own render), or a template that renders new messages the same "
                          "after any history")
        return advice or ["nothing: the defaults keep token truth"]


def _reasoning_format(parser: str, template: str) -> str:
    if parser in ("harmony", "gpt_oss"):
        return "harmony analysis channel (reasoning_content)"
    if "<think>" in template or "reasoning_content" in template:
        return "<think> blocks (reasoning_content)"
    return "none written by the template"


def _writes_tool_calls(renderer: Renderer) -> bool:
    """Whether the template writes an assistant turn's tool call at all (SmolLM2's, say,
    renders only the content): the call's argument shows in the render."""
    call = _assistant(0, call=True)
    text = renderer.render([{"role": "user", "content": "u"}, call], TOOLS)
    return "ls 0" in text


def _stop_tokens(renderer: Renderer) -> list[tuple[int, str]]:
    return [(token_id, renderer.decode([token_id], skip_special_tokens=False))
            for token_id in sorted(renderer.stop_token_ids)]


def _assistant(turn: int, call: bool) -> dict:
    message: dict[str, Any] = {
        "role": "assistant", "reasoning_content": f"Step {turn}: look closer.",
        "content": "Running it." if call else f"Done with step {turn}."}
    if call:
        message["tool_calls"] = [{"id": f"call_{turn}", "type": "function", "function": {
            "name": "bash", "arguments": f'{{"cmd": "ls {turn}"}}'}}]
    return message


def _observation(turn: int, call: bool) -> dict:
    if call:
        return {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"file_{turn}.py"}
    return {"role": "user", "content": f"Observation {turn}: 2 tests fail."}


def _completion_text(renderer: Renderer, messages: list[dict], assistant: dict,
                     following: dict) -> str:
    """What the template writes for `assistant` after the generation prompt, up to and
    including the stop token that ends it (the text a model of this family samples)."""
    history = renderer.render(messages, TOOLS)
    opened = renderer.render(messages, TOOLS, add_generation_prompt=True)[len(history):]
    alone = renderer.render([*messages, assistant], TOOLS)
    matched = opened
    while matched and matched not in alone[len(history) - 1:]:
        matched = matched[:-1]  # a generation prompt that opens a think block, say
    turn = alone[alone.rindex(matched) + len(matched):] if matched else alone[len(history):]
    if "<think>" in opened[len(matched):]:  # the model writes the rest of the block
        turn = f"{assistant['reasoning_content']}\n</think>\n\n{turn}"
    stops = [renderer.decode([i], skip_special_tokens=False)
             for i in sorted(renderer.stop_token_ids)]
    found = [(turn.find(stop), stop) for stop in stops if stop and stop in turn]
    if found:
        index, stop = min(found)
        return turn[:index + len(stop)]
    after = renderer.render_suffix([*messages, assistant, following], len(messages) + 1,
                                   TOOLS) or ""
    starting = [stop for stop in stops if stop and after.startswith(stop)]
    if starting:  # the stop token begins the next message (GLM-4.5)
        return turn + starting[0]
    eos = renderer.eos_text if renderer.eos_text in stops else (stops or [""])[0]
    return turn.removesuffix(renderer.turn_end) + eos  # gpt-oss: <|return|> for <|end|>


def _renders_as_template(renderer: Renderer, messages: list[dict], added_ids: Sequence[int],
                         closing_text: str) -> bool:
    """Whether the IDs added after the sampled ones close the turn and then write the new
    messages as the template writes them after this history."""
    added = renderer.decode(added_ids, skip_special_tokens=False)
    full = renderer.render(messages, TOOLS, add_generation_prompt=True)
    return added.startswith(closing_text) and full.endswith(added[len(closing_text):])


def play_session(renderer: Renderer, parser: str, num_turns: int,
                 strip_reasoning: bool) -> SessionResult:
    result = SessionResult("with reasoning stripped" if strip_reasoning else "verbatim")
    tree, session = Tree("check"), Session("s", "check", "k", 0.0)
    messages = [{"role": "system", "content": "You fix bugs."},
                {"role": "user", "content": "The tests fail; fix them."}]
    previous = None
    for turn in range(num_turns):
        prompt = build_prompt(renderer, messages, TOOLS, session.heads, tree.path_token_ids)
        result.num_calls += 1
        if previous is not None:
            if (prompt.token_truth and prompt.branch is None
                    and prompt.token_ids[:len(previous)] == previous
                    and _renders_as_template(renderer, messages, prompt.token_ids[len(previous):],
                                             renderer.closing_text(previous))):
                result.num_extended += 1
            elif result.first_failure is None:
                result.first_failure = (f"turn {turn}: rendered in full ({prompt.branch}); the "
                                        "template writes the new messages differently after "
                                        "this history")
        call = turn % 3 != 2
        completion = renderer.encode(_completion_text(renderer, messages, _assistant(turn, call),
                                                      _observation(turn, call)))
        text = renderer.decode(completion, not PARSERS[parser].keeps_special_tokens)
        reader = create_parser(parser, tools=TOOLS,
                               prompt_tail=renderer.decode(prompt.token_ids[-8:], False))
        events = reader.feed(text) + reader.finish()
        message = message_of_events(events, lambda turn=turn: f"call_{turn}")
        result.num_tool_calls_lost += call and not message.get("tool_calls")
        tree.add_call(f"c{turn}", "s", prompt.token_ids, completion, [0.0] * len(completion),
                      [0] * len(completion), branch=prompt.branch)
        previous = prompt.token_ids + completion
        session.add_head(Head(f"c{turn}", prompt.message_keys, prompt.tools_key, message,
                              tree.calls[-1].leaf, len(prompt.token_ids),
                              renderer.closing_text(completion), prompt.messages,
                              next_turn_start=renderer.next_turn_start(completion)), 16)
        # content as the gateway gives it to the template (`parse_messages`: a string,
        # never null; gpt-oss's template fails on a null one)
        sent = {**message, "content": message.get("content") or ""}
        if strip_reasoning:
            sent.pop("reasoning_content", None)
        messages = [*messages, sent]
        if call and message.get("tool_calls"):
            messages.append({**_observation(turn, call),
                             "tool_call_id": message["tool_calls"][0]["id"]})
        else:
            messages.append(_observation(turn, False))
    return result


def check_model(model_dir: Path, num_turns: int = 12) -> ModelCheck:
    """Plays an agent session through the pieces a gateway call goes through
    (`build_prompt`, the tool parser, the tree, the session's heads), verbatim and with
    reasoning stripped, each turn "sampling" what the template writes for an assistant
    turn (`_completion_text`); token truth holds when no call would be labelled `rewrite`.
    Gathers the parser, reasoning format, stop and EOS IDs and the vocabulary against the
    embedding's rows (`config.json`'s `vocab_size`) for the report."""
    model_dir = Path(model_dir)
    template = template_of(model_dir)
    parser = resolve_parser("auto", model_dir)
    renderer = Renderer(model_dir)
    check = ModelCheck(model_dir, parser, _reasoning_format(parser, template),
                       _stop_tokens(renderer),
                       num_tokenizer_ids=renderer.tokenizer.get_vocab_size(True),
                       vocab_size=model_vocab_size(model_dir))
    try:
        check.writes_tool_calls = _writes_tool_calls(renderer)
        for strip in (False, True):
            check.sessions.append(play_session(renderer, parser, num_turns, strip))
    except TemplateError as error:
        check.error = error.message
    return check
