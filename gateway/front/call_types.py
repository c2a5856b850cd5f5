"""The values a scaffold call passes through: `CallRequest` in, `Delta`s and `Sampled` out of
sampling (`sampler.py`), `Choice`s in the recorded `Outcome` (`call_record.py`).

Flow: an API module builds a `CallRequest` (with its `SamplingParams`, which go as they are
to the engine driver: one value, from the API to the engine); `CallRunner` (`calls.py`)
yields `Delta`s while the engine samples, then one `Outcome`. All are frozen: a value
handed to the API, remembered for an SDK retry or recorded in the tree does not change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from undertow.gateway.engines.protocol import SamplingParams
from undertow.gateway.front.toolparsers import Event


@dataclass(frozen=True)
class CallRequest:
    """A call in internal form: chat `messages` (OpenAI-style dicts, with
    `reasoning_content`) and `tools`, or raw `prompt_ids` (text completions). Built once,
    whole, by its API module; `parses_tools` is worked out then: tool calls are parsed out
    of the output when they are asked for (`parse_tools`: the tool choice is not none) and
    tools are given."""

    api: str
    model: str
    sampling: SamplingParams  # max_new_tokens None: the gateway's bound (`CallRunner`)
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    parse_tools: bool = True
    prompt_ids: list[int] | None = None
    n: int = 1
    fingerprint: str = ""
    is_retry: bool = False
    template_kwargs: dict | None = None  # chat_template_kwargs, reasoning_effort
    parses_tools: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parses_tools", self.parse_tools and bool(self.tools))


@dataclass(frozen=True)
class Delta:
    """New output of choice `index`: its parsed events and the tokens behind them."""

    index: int
    call_id: str
    events: list[Event]
    token_ids: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class Sampled:
    """One choice as sampled, not yet recorded: what `ChoiceSampler.sample` yields after
    its `Delta`s, for `CallRecorder.record` to put in the tree. `events` are all the parsed events,
    `text` the output less any stop string, `sampling` the parameters the engine was sent
    (the choice's, with its seed and bound: `SamplingParams.for_choice`)."""

    index: int
    call_id: str
    token_ids: list[int]
    events: list[Event]
    logprobs: list[float]
    weight_versions: list[int]
    text: str
    finish_reason: dict
    cached_tokens: int
    first_token_s: float | None
    sampling: SamplingParams
    honours_seeds: bool | None = None  # whether the engines honour `sampling`'s seed (fleet.py)
    storage_tokens: int = 0  # prompt tokens loaded from shared KV storage (`GenerationChunk`)


@dataclass(frozen=True)
class Choice:
    index: int
    call_id: str
    message: dict
    text: str
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: dict

    @property
    def tool_calls(self) -> list[dict]:
        return self.message.get("tool_calls") or []


@dataclass(frozen=True)
class Outcome:
    """A recorded call, as the APIs format it. It holds no prompt (a session remembers
    its last replies for SDK retries, and a long history's IDs would stay alive)."""

    choices: list[Choice]
    num_prompt_tokens: int
    num_cached_tokens: int
    created_s: int = field(default_factory=lambda: int(time.time()))

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.choices)
