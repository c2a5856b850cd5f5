"""The rollout side of the simulator: sessions and the engines that serve them.

An `SimEngine` is processor sharing in "virtual tokens": `position` counts the decode steps every
generating sequence has taken since the engine started, and advances at `1 / decode_step_s(b, c)`
per second. A generating session finishes its turn when `position` reaches its `finish_position`,
so a change of batch only changes the rate, never the sessions' bookkeeping.
"""

import dataclasses
import heapq
import math

from undertow.cells.sim.timing import EngineModel
from undertow.cells.sim.workload import SessionPlan

EPSILON_STEPS = 1e-6


@dataclasses.dataclass
class SessionRun:
    """A session as it runs. `engine_id` is the cell whose slot it holds (None while queued).

    `pending_steps` is a turn's remaining work while the session has no engine to run it on
    (after a migration found no free slot, or a tool returned while it was waiting).
    """

    plan: SessionPlan
    engine_id: int | None = None
    turn_index: int = 0
    context_tokens: int = 0
    num_tokens: int = 0
    started_s: float | None = None
    finished_s: float | None = None
    timed_out: bool = False
    generating: bool = False
    pending_steps: float | None = None

    @property
    def done(self) -> bool:
        return self.finished_s is not None

    @property
    def duration_s(self) -> float:
        """From its start to its end (a done session)."""
        if self.started_s is None or self.finished_s is None:
            raise RuntimeError(f"session {self.plan.session_id} has not run to its end")
        return self.finished_s - self.started_s

    def turn_steps(self, engine: EngineModel) -> float:
        turn = self.plan.turns[self.turn_index]
        return engine.turn_steps(turn.prefill_tokens, turn.completion_tokens)

    def complete_turn(self) -> float | None:
        """Book the finished turn; the tool latency before the next turn, or None if done."""
        turn = self.plan.turns[self.turn_index]
        added = turn.prefill_tokens + turn.completion_tokens
        self.context_tokens += added
        # The prompt is shared by the group and counted once there (see group_tokens).
        self.num_tokens += added - (turn.prefill_tokens if self.turn_index == 0 else 0)
        self.turn_index += 1
        return None if self.turn_index == len(self.plan.turns) else turn.tool_latency_s


class SimEngine:
    """One rollout cell's engine (see the module docstring). `version` invalidates old events."""

    def __init__(self, cell_id: int, model: EngineModel, now_s: float):
        self.cell_id = cell_id
        self.model = model
        self.session_ids: set[int] = set()
        self.position = 0.0
        self.updated_s = now_s
        self.context_tokens = 0
        self.version = 0
        self.busy_s = 0.0
        self._finish: dict[int, tuple[float, int]] = {}  # session -> (finish position, context)
        self._heap: list[tuple[float, int]] = []

    @property
    def num_free_slots(self) -> int:
        return self.model.num_session_slots - len(self.session_ids)

    @property
    def num_generating(self) -> int:
        return len(self._finish)

    def step_s(self) -> float:
        return self.model.decode_step_s(len(self._finish), self.context_tokens)

    def advance(self, now_s: float) -> None:
        elapsed = now_s - self.updated_s
        if self._finish and elapsed > 0:
            self.position += elapsed / self.step_s()
            self.busy_s += elapsed
        self.updated_s = now_s

    def start_generation(self, session_id: int, num_steps: float, context_tokens: int,
                         now_s: float) -> None:
        self.advance(now_s)
        finish = self.position + num_steps
        self._finish[session_id] = (finish, context_tokens)
        self.context_tokens += context_tokens
        heapq.heappush(self._heap, (finish, session_id))
        self.version += 1

    def stop_generation(self, session_id: int, now_s: float) -> float:
        """Take a generating session off; returns the decode steps it still needed."""
        self.advance(now_s)
        finish, context = self._finish.pop(session_id)
        self.context_tokens -= context
        self.version += 1
        return max(0.0, finish - self.position)

    def pop_finished(self, now_s: float) -> list[int]:
        """Sessions whose turn is done by now, in the order they finished."""
        self.advance(now_s)
        done = []
        while self._heap and self._heap[0][0] <= self.position + EPSILON_STEPS:
            finish, session_id = heapq.heappop(self._heap)
            if self._finish.get(session_id, (None,))[0] == finish:
                self.stop_generation(session_id, now_s)
                done.append(session_id)
        self._drop_stale()
        return done

    def next_finish_s(self) -> float:
        """When the next turn would finish at the current rate (inf when none generates)."""
        self._drop_stale()
        if not self._heap:
            return math.inf
        return self.updated_s + (self._heap[0][0] - self.position) * self.step_s()

    def _drop_stale(self) -> None:
        while self._heap and self._finish.get(self._heap[0][1], (None,))[0] != self._heap[0][0]:
            heapq.heappop(self._heap)
