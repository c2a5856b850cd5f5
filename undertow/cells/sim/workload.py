"""Workloads: how long-horizon agent sessions are shaped, and the cluster they run on.

A workload file (YAML or JSON) has the sections `batch`, `session`, `engine` and `trainer`; see
the presets in `workloads/`. Session shapes follow what agent-RL reports publish: turn counts,
tokens per turn and tool latencies are long-tailed (lognormal given by a median and a 99th
percentile, so p99 around 10x the median), and a per-session time limit caps the tail; a session
that hits it is graded on what it has done and still counts as one sample.

Sessions are drawn from a generator seeded by (seed, step), never from the simulation's order of
events, so every policy sees the very same sessions.
"""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import yaml

from undertow.cells.sim.timing import EngineModel, TrainerModel

PRESETS_DIR = Path(__file__).parent / "workloads"
Z_99 = 2.3263478740408408  # the standard normal's 99th percentile


@dataclasses.dataclass(frozen=True)
class LongTail:
    """A lognormal with the given median and 99th percentile, rounded if `integer`, clipped."""

    median: float
    p99: float
    minimum: float = 0.0
    maximum: float = math.inf
    integer: bool = False

    def __post_init__(self):
        if not 0 < self.median <= self.p99:
            raise ValueError(f"long tail: median={self.median}, p99={self.p99}; "
                             "need 0 < median <= p99")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        sigma = math.log(self.p99 / self.median) / Z_99
        values = rng.lognormal(math.log(self.median), sigma, size)
        if self.integer:
            values = np.round(values)
        return np.clip(values, self.minimum, self.maximum)


@dataclasses.dataclass(frozen=True)
class SessionModel:
    """One session: `num_turns` model calls; each call prefills the previous tool output
    (`observation_tokens`; the first prefills the task prompt), generates `completion_tokens`,
    then waits `tool_latency_s` for the tool, except after the last call."""

    num_turns: LongTail
    completion_tokens: LongTail
    observation_tokens: LongTail
    tool_latency_s: LongTail
    prompt_tokens: int
    time_limit_s: float

    def __post_init__(self):
        if self.prompt_tokens < 1 or self.time_limit_s <= 0:
            raise ValueError(f"session: prompt_tokens={self.prompt_tokens} must be >= 1 and "
                             f"time_limit_s={self.time_limit_s} > 0")


@dataclasses.dataclass(frozen=True)
class Turn:
    prefill_tokens: int
    completion_tokens: int
    tool_latency_s: float


@dataclasses.dataclass(frozen=True)
class SessionPlan:
    """What a session would do given unlimited time; the time limit may cut it short."""

    session_id: int
    step: int
    group: int
    turns: tuple[Turn, ...]


@dataclasses.dataclass(frozen=True)
class Workload:
    """Everything a simulation needs besides the policy, the number of cells and of steps."""

    name: str
    num_tasks_per_step: int
    group_size: int
    session: SessionModel
    engine: EngineModel
    trainer: TrainerModel

    @property
    def num_sessions_per_step(self) -> int:
        return self.num_tasks_per_step * self.group_size

    def sample_batch(self, seed: int, step: int) -> list[SessionPlan]:
        """The sessions of one step: tasks x group size, the same for every policy."""
        rng = np.random.default_rng([seed, step])
        shape = self.session
        num_turns = shape.num_turns.sample(rng, self.num_sessions_per_step).astype(int)
        total = int(num_turns.sum())
        completion = shape.completion_tokens.sample(rng, total).astype(int)
        observation = shape.observation_tokens.sample(rng, total).astype(int)
        latency = shape.tool_latency_s.sample(rng, total)
        plans, start = [], 0
        for index, count in enumerate(num_turns):
            turns = tuple(
                Turn(prefill_tokens=(shape.prompt_tokens if t == 0
                                     else int(observation[start + t - 1])),
                     completion_tokens=max(1, int(completion[start + t])),
                     tool_latency_s=float(latency[start + t]) if t < count - 1 else 0.0)
                for t in range(count))
            plans.append(SessionPlan(session_id=step * self.num_sessions_per_step + index,
                                     step=step, group=index // self.group_size, turns=turns))
            start += count
        return plans


def _long_tail(section: dict, key: str) -> LongTail:
    try:
        return LongTail(**section[key])
    except (KeyError, TypeError) as error:
        raise ValueError(f"workload: session.{key} must be a mapping with median, p99 and "
                         f"optionally minimum, maximum, integer ({error})") from None


def workload_from_dict(data: dict) -> Workload:
    """Build and validate a workload from the plain dict of a workload file."""
    try:
        batch, session = data["batch"], data["session"]
        session_model = SessionModel(
            num_turns=_long_tail(session, "num_turns"),
            completion_tokens=_long_tail(session, "completion_tokens"),
            observation_tokens=_long_tail(session, "observation_tokens"),
            tool_latency_s=_long_tail(session, "tool_latency_s"),
            prompt_tokens=int(session["prompt_tokens"]),
            time_limit_s=float(session["time_limit_s"]))
        workload = Workload(
            name=str(data.get("name", "workload")),
            num_tasks_per_step=int(batch["num_tasks_per_step"]),
            group_size=int(batch["group_size"]),
            session=session_model,
            engine=EngineModel(**data["engine"]),
            trainer=TrainerModel(**data["trainer"]))
    except KeyError as error:
        raise ValueError(f"workload: missing {error}; a workload needs the sections batch, "
                         "session, engine and trainer (undertow/cells/sim/workloads/)") from None
    except TypeError as error:
        raise ValueError(f"workload: {error}") from None
    if workload.num_tasks_per_step < 1 or workload.group_size < 1:
        raise ValueError(f"workload: num_tasks_per_step={workload.num_tasks_per_step} and "
                         f"group_size={workload.group_size} must both be >= 1")
    return workload


def load_workload(path_or_preset: str | Path) -> Workload:
    """Load a YAML/JSON workload file, or a preset by name (`qwengyre_long_tail`, `short_tail`)."""
    path = Path(path_or_preset)
    if not path.exists():
        preset = PRESETS_DIR / f"{path_or_preset}.yaml"
        if not preset.exists():
            names = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
            raise FileNotFoundError(f"no workload file {path}; give a YAML/JSON file or one of "
                                    f"the presets {names}")
        path = preset
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"workload {path}: expected a mapping at the top level")
    return workload_from_dict(data)
