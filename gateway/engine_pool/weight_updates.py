"""Pausing the pool and updating the weights of its engines.

Flow: `WeightUpdates.pause(mode)` closes the admission gate (new generations wait), then
either waits for what runs to finish (`drain`, up to `drain_timeout_s`) or interrupts it
at once (`abort_resume`); whatever still runs is interrupted, to resume from its partial
output after `resume()` opens the gate again. `update` is check the checkpoint -> pause ->
load the weights on every live engine -> resume, one update at a time.

Invariants:
- A checkpoint that does not fit the served model (`checkpoints.py`) is refused
  (`IncompatibleCheckpoint`) before the pool pauses: no engine gets it.
- When `pause` returns, nothing of the pool runs on any engine.
- An engine that refuses the load is drained (it serves stale weights); one that stops
  answering during it (SGLang exits on a checkpoint it cannot load) is dead, not stale:
  marked so, the fleet probes it until it answers again (restarted by whoever started it)
  and then gives it the pool's weights. Both are named in the result (`failed`; `dead`
  for the second). `Fleet.weights` (what an engine that joins or returns later is given)
  become the pushed weights unless every live engine failed them.
- Whatever happens during the load, the pool is resumed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from undertow.gateway.engine_pool.admission import Admission
from undertow.gateway.engine_pool.checkpoints import check_checkpoint
from undertow.gateway.engine_pool.fleet import Fleet
from undertow.gateway.engine_pool.inflight import InFlight
from undertow.gateway.engine_pool.router import EngineState
from undertow.gateway.engines.protocol import EngineUnavailable, WeightsNotUpdated

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
        """check -> pause(mode) -> update_weights_from_disk on every live engine -> resume().
        Raises `IncompatibleCheckpoint` (nothing paused) for a checkpoint that does not fit
        the served model. An engine whose update fails is drained (it serves stale
        weights), or marked dead when it stopped answering, and named in the result.
        `pool_weights` in the result are the weights an engine that joins or returns
        later is given: the pushed ones when at least one live engine loaded them, or
        when no engine was live (nothing could refuse them; an engine that cannot load
        them is then refused when it joins); otherwise the previous."""
        async with self._updating:
            serving_dir = self._serving_dir()
            if serving_dir is not None:
                await asyncio.to_thread(check_checkpoint, Path(serving_dir), Path(model_path))
            await self.pause(mode)
            try:
                failed, dead = await self._load(str(model_path), str(weight_version))
            finally:
                await self.resume()
        weights = self.fleet.weights
        return {"weight_version": str(weight_version), "failed": failed, "dead": dead,
                "updated": [e.engine_id for e in self.fleet.engines
                            if e.weight_version == str(weight_version)],
                "pool_weights": None if weights is None else
                {"model_path": weights[0], "weight_version": weights[1]}}

    def _serving_dir(self) -> str | None:
        """The model directory the engines serve: the pool's last weights, else what a live
        engine reported loading (None when none did)."""
        if self.fleet.weights is not None:
            return self.fleet.weights[0]
        return next((e.model_path for e in self.fleet.engines
                     if e.state is not EngineState.DEAD and e.model_path), None)

    async def _load(self, model_path: str, weight_version: str
                    ) -> tuple[dict[str, str], list[str]]:
        """update_weights_from_disk on every live engine; drains those that refuse it and
        marks dead those that stopped answering (their IDs: the second value). Records the
        weights as the pool's unless every live engine failed them."""
        live = [e for e in self.fleet.engines if e.state is not EngineState.DEAD]
        results = await asyncio.gather(
            *(e.driver.update_weights_from_disk(model_path, weight_version) for e in live),
            return_exceptions=True)
        failed: dict[str, str] = {}
        dead: list[str] = []
        for engine, result in zip(live, results, strict=True):
            if isinstance(result, EngineUnavailable):  # it died loading them: not stale
                failed[engine.engine_id] = str(result)
                dead.append(engine.engine_id)
                engine.weight_version = None
                await self.admission.mark_dead(engine, f"it stopped answering while loading "
                                                       f"{model_path}: {result}")
            elif isinstance(result, Exception):
                failed[engine.engine_id] = str(result)
                if isinstance(result, WeightsNotUpdated):  # what the engine really serves
                    engine.weight_version = result.weight_version
                await self.drain(engine.engine_id)
            else:
                engine.weight_version = weight_version
        if not live or len(failed) < len(live):  # weights every engine refused are not
            self.fleet.weights = (model_path, weight_version)
        return failed, dead
