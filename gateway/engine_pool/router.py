"""Routing: which engine serves a session's next generation. Pure logic, no I/O.

The engine pool (`pool.py`, in `admission.py`) asks `Router.route` before every generation
it sends, passing a snapshot of the engines' states and loads, then tells the router where
the generation went with `Router.assign`. The policy:

1. **Sticky**: a session pinned to a healthy engine with room stays there, since
   that engine's prefix cache holds the session's history.
2. **Prefix affinity**: otherwise (a new session, or its engine left, died or is
   full) prefer an engine that recently served a prompt with the same leading
   tokens (e.g. another session of the same task group), as long as its load is
   within `affinity_slack` of the least-loaded engine.
3. **Least loaded**: otherwise the engine with the fewest generations in flight,
   then the fewest pinned sessions, then the earliest added.

Admission is bounded per engine (`max_in_flight_per_engine`) and overall
(`max_in_flight_total`); past either, the decision is a refusal ("busy"): the call waits
for room in `admission.py`'s fair queue for up to `admission_wait_s`, and only past that
is it answered 429 with `Retry-After: retry_after_s`.

Invariants:
- A session is pinned to at most one engine; `num_pinned(engine)` counts exactly
  the sessions whose pin names it.
- Each engine's prefix record holds at most `num_prefixes_per_engine` keys, the
  most recently routed ones.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class EngineState(StrEnum):
    """Lifecycle of an engine in the pool: only healthy engines get new generations;
    draining ones finish what they run; dead ones are health-checked until they return."""

    HEALTHY = "healthy"
    DRAINING = "draining"
    DEAD = "dead"


@dataclass(frozen=True)
class EngineLoad:
    """The router's view of one engine at decision time."""

    engine_id: str
    state: EngineState
    num_in_flight: int


@dataclass(frozen=True)
class RouterConfig:
    """Admission bounds and affinity knobs. `max_in_flight_total=None` means the
    sum of the per-engine bounds. `admission_wait_s`: how long a call that finds every
    engine at its bound waits in the admission queue (fair across groups and sessions,
    `admission.py`) before it is answered 429 with `Retry-After: retry_after_s`; 0
    refuses it at once. `prefix_lengths` are the leading-token counts whose hashes
    identify a prompt's prefix (a prompt shorter than the first one is keyed by its
    whole length)."""

    max_in_flight_per_engine: int = 64
    max_in_flight_total: int | None = None
    admission_wait_s: float = 60.0
    retry_after_s: float = 1.0
    prefix_lengths: tuple[int, ...] = (64, 512, 4096)
    num_prefixes_per_engine: int = 4096
    affinity_slack: int = 4

    def __post_init__(self) -> None:
        if self.max_in_flight_per_engine < 1:
            raise ValueError(f"max_in_flight_per_engine must be >= 1, got "
                             f"{self.max_in_flight_per_engine}")
        if self.max_in_flight_total is not None and self.max_in_flight_total < 1:
            raise ValueError(f"max_in_flight_total must be >= 1 or None, got "
                             f"{self.max_in_flight_total}")
        if not self.prefix_lengths or list(self.prefix_lengths) != sorted(set(self.prefix_lengths)):
            raise ValueError(f"prefix_lengths must be increasing, got {self.prefix_lengths}")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s must be > 0, got {self.retry_after_s}")
        if not 0 <= self.admission_wait_s < float("inf"):
            raise ValueError(f"admission_wait_s must be >= 0 seconds (0 refuses at once), got "
                             f"{self.admission_wait_s}")


@dataclass(frozen=True)
class Decision:
    """Where to send a generation (`engine_id`), and why. A refusal has
    `engine_id=None` and reason "busy" (retry after `retry_after_s`) or
    "unavailable" (no healthy engine)."""

    engine_id: str | None
    reason: str
    retry_after_s: float = 0.0


def prefix_keys(token_ids: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(length, hash) keys of the prompt's leading tokens, shortest first."""
    usable = [n for n in lengths if n <= len(token_ids)] or [len(token_ids)]
    return [(n, hash(tuple(token_ids[:n]))) for n in usable if n > 0]


class Router:
    """Pins sessions to engines and picks engines for new sessions (see module doc)."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config if config is not None else RouterConfig()
        self._pins: dict[str, str] = {}
        self._num_pinned: Counter[str] = Counter()
        self._prefixes: dict[str, OrderedDict[tuple[int, int], None]] = {}

    def pinned(self, session_id: str) -> str | None:
        return self._pins.get(session_id)

    def num_pinned(self, engine_id: str) -> int:
        return self._num_pinned[engine_id]

    def sessions_on(self, engine_id: str) -> list[str]:
        return [session for session, engine in self._pins.items() if engine == engine_id]

    def route(self, session_id: str, token_ids: Sequence[int],
              engines: Sequence[EngineLoad], *, bounded: bool = True) -> Decision:
        """`bounded=False` skips admission, for a generation admitted earlier that
        resumes after its engine died, drained or paused."""
        config = self.config
        healthy = [e for e in engines if e.state is EngineState.HEALTHY]
        if not healthy:
            return Decision(None, "unavailable")
        open_engines = healthy
        if bounded:
            total_limit = config.max_in_flight_total
            if total_limit is None:
                total_limit = config.max_in_flight_per_engine * len(healthy)
            if sum(e.num_in_flight for e in engines) >= total_limit:
                return Decision(None, "busy", config.retry_after_s)
            open_engines = [e for e in healthy
                            if e.num_in_flight < config.max_in_flight_per_engine]
            if not open_engines:
                return Decision(None, "busy", config.retry_after_s)
        pin = self._pins.get(session_id)
        if any(e.engine_id == pin for e in open_engines):
            return Decision(pin, "pinned")
        order = {e.engine_id: index for index, e in enumerate(engines)}

        def load(e: EngineLoad) -> tuple[int, int, int]:
            return (e.num_in_flight, self._num_pinned[e.engine_id], order[e.engine_id])

        least = min(open_engines, key=load)
        affine = self._best_prefix_match(token_ids, open_engines)
        if affine:
            best = min(affine, key=load)
            if best.num_in_flight <= least.num_in_flight + config.affinity_slack:
                return Decision(best.engine_id, "prefix")
        return Decision(least.engine_id, "least_loaded" if pin is None else "moved")

    def _best_prefix_match(self, token_ids: Sequence[int],
                           engines: Sequence[EngineLoad]) -> list[EngineLoad]:
        """The engines whose record holds the longest of the prompt's prefix keys."""
        for key in reversed(prefix_keys(token_ids, self.config.prefix_lengths)):
            matches = [e for e in engines if key in self._prefixes.get(e.engine_id, ())]
            if matches:
                return matches
        return []

    def assign(self, session_id: str, engine_id: str, token_ids: Sequence[int]) -> None:
        """Pins the session to the engine and remembers the prompt's prefix there."""
        previous = self._pins.get(session_id)
        if previous != engine_id:
            if previous is not None:
                self._num_pinned[previous] -= 1
            self._pins[session_id] = engine_id
            self._num_pinned[engine_id] += 1
        record = self._prefixes.setdefault(engine_id, OrderedDict())
        for key in prefix_keys(token_ids, self.config.prefix_lengths):
            record[key] = None
            record.move_to_end(key)
        while len(record) > self.config.num_prefixes_per_engine:
            record.popitem(last=False)

    def unpin(self, session_id: str) -> None:
        engine_id = self._pins.pop(session_id, None)
        if engine_id is not None:
            self._num_pinned[engine_id] -= 1

    def unpin_engine(self, engine_id: str) -> list[str]:
        """Unpins every session of the engine (it drains or died), so that their next
        generation is routed elsewhere; returns those sessions."""
        sessions = self.sessions_on(engine_id)
        for session_id in sessions:
            del self._pins[session_id]
        self._num_pinned.pop(engine_id, None)
        return sessions

    def forget_engine(self, engine_id: str) -> None:
        """The engine left the pool, and its prefix cache with it."""
        self.unpin_engine(engine_id)
        self._prefixes.pop(engine_id, None)
