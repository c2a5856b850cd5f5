"""The learner side of the simulator: a data-parallel step whose membership may change.

The open step's finished groups queue their unique tokens; the training cells drain the queue
at `num_cells * tokens_per_s_per_cell` (fluid: micro-steps are not modelled one by one, so a cell
that joins contributes from the moment it arrives). Once the step's batch is complete and its
queue empty, the optimizer step and then the weight sync run, and the weights are published.
"""

import enum

from undertow.cells.sim.timing import TrainerModel


class Phase(enum.Enum):
    IDLE = "idle"
    TRAINING = "training"
    OPTIMIZER = "optimizer"
    SYNC = "sync"


class Learner:
    """The learner's state in the simulation. `version` invalidates old events.

    Invariants: `pending_tokens >= 0`; `step` is None exactly in phase IDLE; `busy_cell_s`
    counts cell-seconds spent on tokens or on the optimizer step.
    """

    def __init__(self, model: TrainerModel):
        self.model = model
        self.phase = Phase.IDLE
        self.step: int | None = None
        self.num_cells = 0
        self.pending_tokens = 0.0
        self.updated_s = 0.0
        self.version = 0
        self.busy_cell_s = 0.0
        self.phase_ends_s: float | None = None

    def advance(self, now_s: float) -> None:
        elapsed = now_s - self.updated_s
        if elapsed > 0 and self.num_cells:
            if self.phase is Phase.TRAINING and self.pending_tokens > 0:
                rate = self.num_cells * self.model.tokens_per_s_per_cell
                worked_s = min(elapsed, self.pending_tokens / rate)
                self.pending_tokens = max(0.0, self.pending_tokens - rate * elapsed)
                self.busy_cell_s += self.num_cells * worked_s
            elif self.phase is Phase.OPTIMIZER:
                self.busy_cell_s += self.num_cells * elapsed
        self.updated_s = now_s

    def open(self, step: int, buffered_tokens: float, now_s: float) -> None:
        if self.phase is not Phase.IDLE:
            raise RuntimeError(f"the learner is still on step {self.step}; cannot open {step}")
        self.advance(now_s)
        self.phase, self.step, self.pending_tokens = Phase.TRAINING, step, buffered_tokens
        self.version += 1

    def add_tokens(self, num_tokens: float, now_s: float) -> None:
        self.advance(now_s)
        self.pending_tokens += num_tokens
        self.version += 1

    def set_cells(self, num_cells: int, now_s: float) -> None:
        self.advance(now_s)
        self.num_cells = num_cells
        self.version += 1

    def queue_empty_s(self) -> float | None:
        """When the queue will be empty at the current rate (None if it never drains now)."""
        if self.phase is not Phase.TRAINING or not self.num_cells:
            return None
        rate = self.num_cells * self.model.tokens_per_s_per_cell
        return self.updated_s + self.pending_tokens / rate

    def begin(self, phase: Phase, now_s: float) -> float:
        """Enter the optimizer or sync phase; returns when it ends."""
        self.advance(now_s)
        duration = (self.model.optimizer_step_s if phase is Phase.OPTIMIZER
                    else self.model.weight_sync_s)
        self.phase, self.phase_ends_s = phase, now_s + duration
        self.version += 1
        return self.phase_ends_s

    def close(self, now_s: float) -> int:
        """Publish: returns the step that finished; the learner is idle again."""
        if self.step is None:
            raise RuntimeError("the learner has no open step to publish")
        self.advance(now_s)
        step, self.step, self.phase, self.phase_ends_s = self.step, None, Phase.IDLE, None
        self.version += 1
        return step
