"""Chat rollouts: tasks that need no repository, no sandbox and no scaffold program, one chat
call a session. The task set's format, the reward call and the failures:
docs/adapters.md#chat-rollouts.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from undertow.adapters.errors import RewardError, RolloutError
from undertow.adapters.gateway_client import GatewayAdmin
from undertow.adapters.summary import SessionResult, is_infra_failure

# A user's function, loaded by name: it should return a number, and `score` checks that it does.
RewardFunction = Callable[[list[dict[str, Any]], dict[str, Any]], object]


@dataclass(frozen=True)
class PromptTask:
    """One row of a prompt task set. Invariant: `messages` is non-empty and `reward`
    has the form `module:function`; `fields` holds the whole row."""

    instance_id: str
    messages: tuple[dict[str, Any], ...]
    reward: str
    fields: dict[str, Any] = field(default_factory=dict)


def load_prompt_tasks(path: Path) -> list[PromptTask]:
    """The tasks of a `.jsonl`, `.yaml` or `.yml` file; a bad row is a RolloutError
    naming its line (or position) and what is wrong."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        rows = yaml.safe_load(text) or []
        if not isinstance(rows, list):
            raise RolloutError(f"{path}: a prompt task set must be a list of tasks")
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [_task(row, f"{path}, task {number}") for number, row in enumerate(rows, 1)]


def _task(row: object, where: str) -> PromptTask:
    if not isinstance(row, dict) or not row.get("instance_id"):
        raise RolloutError(f"{where}: a task is a mapping with an instance_id, got {row!r}")
    name = row["instance_id"]
    if "messages" in row:
        messages = tuple(row["messages"])
    elif "prompt" in row:
        messages = ({"role": "user", "content": str(row["prompt"])},)
    else:
        raise RolloutError(f"{where} ({name}): needs 'prompt' or 'messages'")
    reward = row.get("reward", "")
    if not isinstance(reward, str) or ":" not in reward:
        raise RolloutError(f"{where} ({name}): 'reward' must name a function as "
                           f"'module:function', got {reward!r}")
    if not messages:
        raise RolloutError(f"{where} ({name}): 'messages' is empty")
    return PromptTask(name, messages, reward, dict(row))


def reward_function(task: PromptTask) -> RewardFunction:
    """The function `task.reward` names; a RolloutError names the task and the function
    when it cannot be imported or is not callable."""
    module_name, _, attribute = task.reward.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise RolloutError(f"task {task.instance_id}: reward function {task.reward!r} cannot "
                           f"be loaded ({type(error).__name__}: {error}); check its "
                           "module:function") from None
    if not callable(function):
        raise RolloutError(f"task {task.instance_id}: reward {task.reward!r} is not callable")
    return function


def score(task: PromptTask, function: RewardFunction, messages: list[dict[str, Any]]) -> float:
    """`function(messages, task fields)` as a float; RewardError naming the task and the
    function when it raises or returns something else than a number."""
    try:
        value = function(messages, dict(task.fields))
    except Exception as error:
        raise RewardError(f"task {task.instance_id}: reward function {task.reward} raised "
                          f"{type(error).__name__}: {error}") from None
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float):
        raise RewardError(f"task {task.instance_id}: reward function {task.reward} returned "
                          f"{value!r}, not a number")
    return float(value)


@dataclass(frozen=True)
class ChatRolloutConfig:
    """One group's sessions: `group_size` slots, `concurrency` at once, each slot tried
    up to `max_attempts` times while it ends in a failure of Undertow's own."""

    group_size: int = 8
    concurrency: int = 8
    max_tokens: int = 8
    temperature: float = 1.0
    timeout_s: float = 120.0
    max_attempts: int = 3
    model_name: str = "undertow"

    def __post_init__(self):
        for name in ("group_size", "concurrency", "max_tokens", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"ChatRolloutConfig.{name} must be >= 1, "
                                 f"got {getattr(self, name)}")


class ChatRollout:
    """Runs groups of one-call chat sessions of prompt tasks against a gateway."""

    def __init__(self, admin: GatewayAdmin, config: ChatRolloutConfig):
        self.admin, self.config = admin, config

    async def run_group(self, task: PromptTask, group: str,
                        meta: dict[str, Any] | None = None) -> list[SessionResult]:
        """Every attempt of every slot of `group` on `task`, in the order they ended."""
        function = reward_function(task)
        results: list[SessionResult] = []
        slots = asyncio.Semaphore(self.config.concurrency)
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:

            async def run_slot(index: int) -> None:
                for attempt in range(self.config.max_attempts):
                    result = SessionResult(task.instance_id, index, attempt=attempt)
                    async with slots:
                        await self._session(http, task, function, group, result, meta or {})
                    results.append(result)
                    if not is_infra_failure(result.cause):
                        return

            async with asyncio.TaskGroup() as sessions:
                for index in range(self.config.group_size):
                    sessions.create_task(run_slot(index))
        return results

    async def _session(self, http: aiohttp.ClientSession, task: PromptTask,
                       function: RewardFunction, group: str, result: SessionResult,
                       meta: dict[str, Any]) -> None:
        started, stage = time.monotonic(), "open"
        try:
            opened = await self.admin.open_session(
                group, {**meta, "instance_id": task.instance_id, "index": result.index,
                        "attempt": result.attempt, "scaffold": "chat"})
            result.session_id, stage = opened["session_id"], "gateway"
            messages = [*map(dict, task.messages)]
            reply = await self._chat(http, opened, messages)
            messages.append({"role": "assistant", "content": reply})
            stage = "reward"
            result.reward = score(task, function, messages)
            result.cause, result.reward_source = "exited", "reward_function"
            result.resolved = result.reward >= 1.0
            result.details = {"reply": reply}
        except Exception as error:
            result.cause, result.reward = f"error:{stage}", 0.0
            result.error = f"{type(error).__name__}: {error}"
        finally:
            result.duration_s = time.monotonic() - started
            if result.session_id:
                await asyncio.shield(self._close(result))

    async def _chat(self, http: aiohttp.ClientSession, opened: dict[str, Any],
                    messages: Sequence[dict[str, Any]]) -> str:
        body = {"model": self.config.model_name, "messages": list(messages),
                "max_tokens": self.config.max_tokens, "temperature": self.config.temperature}
        headers = {"Authorization": f"Bearer {opened['api_key']}"}
        async with http.post(f"{opened['base_url']}/chat/completions", json=body,
                             headers=headers) as reply:
            text = await reply.text()
            if reply.status >= 400:
                raise RolloutError(f"the gateway answered {reply.status}: {text[:300]}")
        choice = json.loads(text)["choices"][0]
        return choice["message"].get("content") or ""

    async def _close(self, result: SessionResult) -> None:
        try:
            tree = await self.admin.session_tree(result.session_id)
            calls = tree.get("calls", [])
            result.num_calls = len(calls)
            result.num_prompt_tokens = sum(call["num_prompt_tokens"] for call in calls)
            result.num_completion_tokens = sum(c["num_completion_tokens"] for c in calls)
            closed = await self.admin.close_session(result.session_id, result.reward,
                                                    result.meta())
            result.take_verdict(closed.get("meta") or {})
            result.closed = True
        except Exception as error:
            result.error = result.error or f"closing at the gateway failed: {error}"
