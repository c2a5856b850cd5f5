"""Reward functions for prompt task sets (`adapters/chat_rollout.py`), named in a task
row as `reward: undertow.adapters.rewards:<function>`.

A reward function is called as `function(messages, task)`: `messages` is the
session's chat, the policy's reply last (`{"role": "assistant", "content": ...}`),
and `task` holds every field of the task's row. It returns a number (or a bool).
"""

from typing import Any


def reply_text(messages: list[dict[str, Any]]) -> str:
    """The policy's reply: the content of the last assistant message."""
    replies = [m for m in messages if m.get("role") == "assistant"]
    if not replies:
        raise ValueError("the session has no assistant message")
    return str(replies[-1].get("content") or "")


def exact_answer(messages: list[dict[str, Any]], task: dict[str, Any]) -> float:
    """1.0 when the reply, stripped of surrounding space and case, is the task's
    `answer`; else 0.0."""
    if "answer" not in task:
        raise KeyError("exact_answer needs an 'answer' field in the task")
    return float(reply_text(messages).strip().lower() == str(task["answer"]).strip().lower())
