"""Reward functions for prompt task sets, named in a task row as
`reward: undertow.adapters.rewards:<function>`; how they are called: docs/adapters.md#chat-rollouts.
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
