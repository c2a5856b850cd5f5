"""The admission queue: calls that found every engine at its bound, in the order they get in.

`admission.Admission` puts a first attempt here when the router refuses it as "busy" (or
while the pool is paused), and takes the next one out each time an attempt ends, an engine
joins or the gate opens. The order is fair, not first come first served:

- **Two lanes, taken in turn.** Later calls of sessions that already had a call admitted
  ("later") and first calls of new sessions ("first"). When both hold calls, the lane not
  served last goes next; when one is empty the other takes every slot. A strict priority
  either way starves someone: later calls first would shut out every new group while
  started sessions keep the engines full (one big group could then starve another group's
  first call), and one shared order would put a session's later call behind every new
  session that arrived meanwhile. Alternating bounds both: a later call waits for at most
  one first call per later call ahead of it, whatever the flood of new sessions, and a
  first call likewise, whatever the burst of later ones. A started session is worth
  finishing soon: its sandbox and scaffold are held, its prefix is warm in the engine's
  cache, and its group trains only once every session in it is done.
- **Inside a lane, round-robin over groups, then over sessions, FIFO inside a session.**
  One group's burst of N calls delays another group's first call by one call, not by N;
  a session with several calls waiting (choices, parallel tool calls) gets one per turn.

Invariants:
- A waiter is in at most one lane, once; `num_waiting` counts exactly the waiters held.
- `next` does not change the order; `pop` takes exactly the waiter `next` names and moves
  its group and session to the back of their rotations; `discard` takes a waiter out from
  anywhere without moving anyone else.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from undertow.gateway.engine_pool.fleet import Attempt

LANES = ("later", "first")


def _always_present() -> bool:
    return True


@dataclass(frozen=True)
class Caller:
    """Who a generation is for: the session's `group` (the queue's fairness unit) and
    `present`, which says whether the client is still connected (a waiting call whose
    client left leaves the queue)."""

    group: str = ""
    present: Callable[[], bool] = _always_present


@dataclass(eq=False)
class Waiter:
    """One first attempt waiting for admission; `future` gets its `Attempt` (already
    registered on its engine) or the error it ends with. `deadline_s` is on the event
    loop's clock; `enqueued_s` too."""

    session_id: str
    token_ids: Sequence[int]
    rid: str
    caller: Caller
    lane: str
    enqueued_s: float
    deadline_s: float
    future: asyncio.Future[Attempt] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class _Lane:
    """Groups in rotation, each with its sessions in rotation, each with a FIFO of waiters."""

    def __init__(self) -> None:
        self.groups: OrderedDict[str, OrderedDict[str, deque[Waiter]]] = OrderedDict()

    def add(self, waiter: Waiter) -> None:
        sessions = self.groups.setdefault(waiter.caller.group, OrderedDict())
        sessions.setdefault(waiter.session_id, deque()).append(waiter)

    def next(self) -> Waiter | None:
        for sessions in self.groups.values():
            for waiters in sessions.values():
                return waiters[0]
        return None

    def remove(self, waiter: Waiter, *, rotate: bool) -> None:
        group = waiter.caller.group
        sessions = self.groups[group]
        waiters = sessions[waiter.session_id]
        waiters.remove(waiter)
        if not waiters:
            del sessions[waiter.session_id]
        elif rotate:
            sessions.move_to_end(waiter.session_id)
        if not sessions:
            del self.groups[group]
        elif rotate:
            self.groups.move_to_end(group)

    def __iter__(self) -> Iterator[Waiter]:
        for sessions in self.groups.values():
            for waiters in sessions.values():
                yield from waiters


class AdmissionQueue:
    """The waiting calls of one pool, in fair order (see the module doc)."""

    def __init__(self) -> None:
        self._lanes = {name: _Lane() for name in LANES}
        self._last_lane = "first"  # so that "later" goes first when both hold calls
        self.num_waiting = 0

    def __bool__(self) -> bool:
        return self.num_waiting > 0

    def __iter__(self) -> Iterator[Waiter]:
        return iter([waiter for lane in self._lanes.values() for waiter in lane])

    def add(self, waiter: Waiter) -> None:
        self._lanes[waiter.lane].add(waiter)
        self.num_waiting += 1

    def next(self) -> Waiter | None:
        """The waiter that gets the next free slot (None when none waits)."""
        other = LANES[1] if self._last_lane == LANES[0] else LANES[0]
        for name in (other, self._last_lane):
            waiter = self._lanes[name].next()
            if waiter is not None:
                return waiter
        return None

    def pop(self, waiter: Waiter) -> None:
        """Takes out `waiter`, which `next` has just named, and rotates after it."""
        self._lanes[waiter.lane].remove(waiter, rotate=True)
        self._last_lane = waiter.lane
        self.num_waiting -= 1

    def discard(self, waiter: Waiter) -> bool:
        """Takes out a waiter that leaves early (its client left, its wait ran out, the
        pool failed it); False when it was not held."""
        lane = self._lanes[waiter.lane]
        sessions = lane.groups.get(waiter.caller.group)
        if sessions is None or waiter not in sessions.get(waiter.session_id, ()):
            return False
        lane.remove(waiter, rotate=False)
        self.num_waiting -= 1
        return True
