"""The values a scaffold call passes through: `CallRequest` in, `Delta`s and `Sampled` out of
sampling (`sampler.py`), `Choice`s in the recorded `Outcome` (`call_record.py`).

Flow: an API module builds a `CallRequest` (with its `Sampling`); `CallRunner` (`calls.py`)
yields `Delta`s while the engine samples, then one `Outcome`. All are frozen: a value
handed to the API, remembered for an SDK retry or recorded in the tree does not change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from undertow.gateway.engines.protocol import random_seed
from undertow.gateway.toolparsers import Event


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters in SGLang's names; `max_new_tokens=None` fills the context."""

    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    constraint: tuple[str, str] | None = None  # (SGLang's json_schema|regex|ebnf, its text)

    def to_engine(self, max_new_tokens: int, index: int) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens,
                                  "temperature": self.temperature, "top_p": self.top_p,
                                  "top_k": self.top_k}
        if self.stop:
            params["stop"] = list(self.stop)
        # Always a seed, recorded with the call so that it can be replayed: SGLang 0.5.23
        # gives a request without one the seed 42 (engines/client.py, item 1).
        params["sampling_seed"] = random_seed() if self.seed is None else self.seed + index
        if self.constraint is not None:
            params[self.constraint[0]] = self.constraint[1]
        return params


@dataclass(frozen=True)
class CallRequest:
    """A call in internal form: chat `messages` (OpenAI-style dicts, with
    `reasoning_content`) and `tools`, or raw `prompt_ids` (text completions)."""

    api: str
    model: str
    sampling: Sampling
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    parse_tools: bool = True
    prompt_ids: list[int] | None = None
    n: int = 1
    fingerprint: str = ""
    is_retry: bool = False
    template_kwargs: dict | None = None  # chat_template_kwargs, reasoning_effort
    tool_parser: str | None = None  # instead of the gateway's (forced tool calls)

    @property
    def parses_tools(self) -> bool:
        """Whether tool calls are parsed out of the output (asked for, and tools given)."""
        return self.parse_tools and bool(self.tools)


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
    `text` the output less any stop string, `sampling` the engine's sampling parameters."""

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
    sampling: dict[str, Any]


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
