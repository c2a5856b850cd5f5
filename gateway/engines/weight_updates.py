"""Pausing the pool and updating the weights of its engines.

Flow: `WeightUpdates.pause(mode)` closes the admission gate (new generations wait), then
either waits for what runs to finish (`drain`, up to `drain_timeout_s`) or interrupts it
at once (`abort_resume`); whatever still runs is interrupted, to resume from its partial
output after `resume()` opens the gate again. `update` is pause -> load the weights on
every live engine -> resume, one update at a time.

Invariants:
- When `pause` returns, nothing of the pool runs on any engine.
- An engine whose load fails is drained (it serves stale weights) and named in the
  result; `Fleet.weights` (what an engine that joins or returns later is given) become
  the pushed weights unless every live engine refused them.
- Whatever happens during the load, the pool is resumed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from undertow.gateway.engines.admission import Admission
from undertow.gateway.engines.fleet import Fleet
from undertow.gateway.engines.inflight import InFlight
from undertow.gateway.engines.protocol import WeightsNotUpdated
from undertow.gateway.engines.router import EngineState

PAUSE_MODES = ("drain", "abort_resume")


class WeightUpdates:
    """Pause, resume and weight updates of the pool's engines (see the module doc).
    `drain(engine_id)` takes an engine out of routing, as the pool's `drain_engine`."""

    def __init__(self, admission: Admission, inflight: InFlight, fleet: Fleet,
                 drain: Callable[[str], Awaitable[Any]],
                 drain_timeout_s: float | None = None) -> None:
        self.admission = admission
        self.inflight = inflight
        self.fleet = fleet
        self.drain = drain
        self.drain_timeout_s = drain_timeout_s
        self._updating = asyncio.Lock()  # one weight update at a time

    async def pause(self, mode: str) -> None:
        """Stops admitting generations (new ones wait). `drain`: waits until in-flight
        generations finish (past `drain_timeout_s`, the rest are aborted and resumed
        as in abort_resume). `abort_resume`: aborts them; each resumes from its
        partial output after `resume()`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.admission.close_gate()

        def idle() -> bool:
            return not self.fleet.in_flight()

        if mode == "drain":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.drain_timeout_s):
                    await self.fleet.wait_until(idle)
        await self.inflight.interrupt(self.fleet.in_flight(), "pause")
        await self.fleet.wait_until(idle)

    async def resume(self) -> None:
        await self.admission.open_gate()

    async def update(self, model_path: str, weight_version: int | str,
                     mode: str = "drain") -> dict[str, Any]:
        """pause(mode) -> update_weights_from_disk on every live engine -> resume().
        An engine whose update fails is drained (it serves stale weights) and named
        in the result. `pool_weights` in the result are the weights an engine that
        joins or returns later is given: the pushed ones when at least one live engine
        loaded them, or when no engine was live (nothing could refuse them; an engine
        that cannot load them is then refused when it joins); otherwise the previous."""
        async with self._updating:
            await self.pause(mode)
            try:
                failed = await self._load(str(model_path), str(weight_version))
            finally:
                await self.resume()
        weights = self.fleet.weights
        return {"weight_version": str(weight_version), "failed": failed,
                "updated": [e.engine_id for e in self.fleet.engines
                            if e.weight_version == str(weight_version)],
                "pool_weights": None if weights is None else
                {"model_path": weights[0], "weight_version": weights[1]}}

    async def _load(self, model_path: str, weight_version: str) -> dict[str, str]:
        """update_weights_from_disk on every live engine; drains those that fail.
        Records the weights as the pool's unless every live engine failed them."""
        live = [e for e in self.fleet.engines if e.state is not EngineState.DEAD]
        results = await asyncio.gather(
            *(e.client.update_weights_from_disk(model_path, weight_version) for e in live),
            return_exceptions=True)
        failed: dict[str, str] = {}
        for engine, result in zip(live, results, strict=True):
            if isinstance(result, Exception):
                failed[engine.engine_id] = str(result)
                if isinstance(result, WeightsNotUpdated):  # what the engine really serves
                    engine.weight_version = result.weight_version
                await self.drain(engine.engine_id)
            else:
                engine.weight_version = weight_version
        if not live or len(failed) < len(live):  # weights every engine refused are not
            self.fleet.weights = (model_path, weight_version)
        return failed
