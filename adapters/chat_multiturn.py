"""Multi-turn chat rollouts (`rollout.scaffold: chat-multiturn`): a lookup task whose second
call needs the first call's tool result.
See docs/adapters.md#multi-turn-a-lookup-through-a-tool-result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from undertow.adapters.chat_rollout import (
    ChatRollout,
    ChatRolloutConfig,
    PromptTask,
    RewardFunction,
    score,
)
from undertow.adapters.errors import RolloutError
from undertow.adapters.gateway_client import GatewayAdmin
from undertow.adapters.summary import SessionResult

LOOKUP = re.compile(r"lookup\(\s*['\"]?([^'\")\s]+)['\"]?\s*\)")
NO_SUCH_KEY = "error: no such key"


@dataclass(frozen=True)
class ChatMultiturnConfig(ChatRolloutConfig):
    """`ChatRolloutConfig` (`max_tokens` bounds each call's reply) plus the lookup
    task's values and the `drop_tool_result` fault switch (docs/adapters.md)."""

    min_value: int = 10
    max_value: int = 99
    seed: int = 0
    drop_tool_result: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.min_value > self.max_value:
            raise ValueError(f"ChatMultiturnConfig.min_value ({self.min_value}) must be <= "
                             f"max_value ({self.max_value})")


def session_value(config: ChatMultiturnConfig, group: str, index: int, attempt: int) -> int:
    """The value a session's lookup returns: fixed by (seed, group, slot, attempt)."""
    rng = random.Random(f"{config.seed}/{group}/{index}/{attempt}")
    return rng.randint(config.min_value, config.max_value)


def tool_result(reply: str, key: str, value: int) -> str:
    """What the tool answers to `reply`: the value when it calls lookup(key)."""
    called = LOOKUP.search(reply)
    return str(value) if called and called.group(1) == key else NO_SUCH_KEY


class ChatMultiturnRollout(ChatRollout):
    """Runs groups of two-call lookup sessions (docs/adapters.md) against a gateway."""

    def __init__(self, admin: GatewayAdmin, config: ChatRolloutConfig):
        super().__init__(admin, config)
        self.multiturn = config if isinstance(config, ChatMultiturnConfig) else \
            ChatMultiturnConfig(**dataclasses.asdict(config))

    async def run_group(self, task: PromptTask, group: str,
                        meta: dict[str, Any] | None = None) -> list[SessionResult]:
        if "key" not in task.fields:
            raise RolloutError(f"task {task.instance_id}: a chat-multiturn task needs a 'key' "
                               "field (the key its question asks the value of)")
        return await super().run_group(task, group, meta)

    async def _session(self, http: aiohttp.ClientSession, task: PromptTask,
                       function: RewardFunction, group: str, result: SessionResult,
                       meta: dict[str, Any]) -> None:
        started, stage = time.monotonic(), "open"
        value = session_value(self.multiturn, group, result.index, result.attempt)
        try:
            opened = await self.admin.open_session(
                group, {**meta, "instance_id": task.instance_id, "index": result.index,
                        "attempt": result.attempt, "scaffold": "chat-multiturn",
                        "value": value})
            result.session_id, stage = opened["session_id"], "gateway"
            messages = [*map(dict, task.messages)]
            first = await self._chat(http, opened, messages)
            answer = tool_result(first, str(task.fields["key"]), value)
            messages += [{"role": "assistant", "content": first},
                         {"role": "tool", "content": "" if self.multiturn.drop_tool_result
                          else answer}]
            second = await self._chat(http, opened, messages)
            messages.append({"role": "assistant", "content": second})
            stage = "reward"
            valued = dataclasses.replace(task, fields={**task.fields, "answer": str(value)})
            result.reward = score(valued, function, messages)
            result.cause, result.reward_source = "exited", "reward_function"
            result.resolved = result.reward >= 1.0
            result.details = {"replies": [first, second], "tool_result": answer,
                              "value": value}
        except Exception as error:
            result.cause, result.reward = f"error:{stage}", 0.0
            result.error = f"{type(error).__name__}: {error}"
        finally:
            result.duration_s = time.monotonic() - started
            if result.session_id:
                await asyncio.shield(self._close(result))
