"""Background tasks that the engine pool starts and does not await.

Flow: `spawn` starts a coroutine as a task and keeps a reference to it until it is done
(asyncio holds only weak ones); `adopt` keeps a task started elsewhere the same way;
`cancel_all` cancels every task still running and waits for them (the pool's `close`).

Invariant: every task in `tasks` is unfinished or about to be discarded by its own
done-callback; nothing the pool spawned outlives `cancel_all`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    """The pool's fire-and-forget tasks (aborts, notifications, finishing pumps)."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        self.adopt(asyncio.create_task(coroutine))

    def adopt(self, task: asyncio.Task) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def cancel_all(self, *others: asyncio.Task) -> None:
        """Cancels the background tasks and `others`, and waits until all have ended."""
        tasks = [*self.tasks, *others]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
