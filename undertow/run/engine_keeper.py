"""Engines Undertow launched are kept serving: one that dies is started again on its port.

`KeptEngine` watches the server process of an engine Undertow started (the built-in
engine of `embedded.py`, a rollout cell's engine in `undertow/cells/pool.py`) and, when it
exits without being stopped, starts the same launcher on the same model directory and
port, so that the engine pool's record stays and the engine rejoins with the pool's
weights (docs/api.md, "An engine that dies during an update"). An engine the user
started is never restarted here.

    engine = await KeptEngine.start(BuiltinLauncher(), model_dir, log_path)
    ...                  # engine.url serves, across deaths, until:
    await engine.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from undertow.gateway.engines.launch import Launcher, RunningEngine, start_engine
from undertow.gateway.engines.protocol import EngineDriver, EngineLaunchError

log = logging.getLogger(__name__)

POLL_S = 0.5
MAX_FAILED_STARTS = 5     # starts in a row that fail before the engine is given up


@dataclass(frozen=True)
class OnPort:
    """`launcher` told to listen on `port` (the port its first start got): a restarted
    engine keeps its URL. The server prints the URL it listens on, which is read back."""

    launcher: Launcher
    port: int
    needs_port: bool = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.launcher, name)

    def command(self, model_dir: Path, port: int | None) -> list[str]:
        return self.launcher.command(model_dir, self.port)


class KeptEngine:
    """A launched engine server restarted on its port whenever it exits unasked.

    Invariants: `running` is the current server process (the first, or the latest
    restart); `url` never changes; after `stop()` nothing is restarted and no server
    process of it is left. `num_restarts` counts the restarts so far."""

    def __init__(self, launcher: Launcher, model_dir: Path, log_path: Path,
                 running: RunningEngine):
        self.launcher, self.model_dir, self.log_path = launcher, Path(model_dir), log_path
        self.running = running
        self.url = running.url
        self.num_restarts = 0
        self._stopping = False
        self._watch = asyncio.get_running_loop().create_task(
            self._keep(), name=f"keep-engine-{running.url}")

    @classmethod
    async def start(cls, launcher: Launcher, model_dir: Path, log_path: Path) -> KeptEngine:
        """Starts the engine (`launch.start_engine`, raising `EngineLaunchError`) and
        keeps it."""
        return cls(launcher, model_dir, log_path,
                   await start_engine(launcher, model_dir, log_path=log_path))

    @property
    def process(self) -> subprocess.Popen:
        return self.running.process

    def driver(self) -> EngineDriver:
        return self.launcher.driver(self.url)

    async def stop(self) -> None:
        """Stops watching, then the server (its process group)."""
        self._stopping = True
        self._watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watch
        await self.running.stop()

    async def _keep(self) -> None:
        """Forever: waits for the server to exit, then starts it again on its port."""
        num_failed, port = 0, urllib.parse.urlsplit(self.url).port
        assert port is not None   # start_engine's URLs carry their port
        while not self._stopping:
            await asyncio.sleep(POLL_S)
            code = self.running.process.poll()
            if code is None:
                continue
            self.num_restarts += 1
            log_path = self.log_path.with_name(
                f"{self.log_path.stem}-restart-{self.num_restarts}{self.log_path.suffix}")
            log.warning("engine at %s exited with code %s while serving; starting it again "
                        "on its port (restart %d, log %s)", self.url, code,
                        self.num_restarts, log_path)
            try:
                # OnPort forwards every other member of the Launcher protocol.
                on_port = cast(Launcher, OnPort(self.launcher, port))
                self.running = await start_engine(on_port, self.model_dir, log_path=log_path)
            except EngineLaunchError as error:
                num_failed += 1
                log.error("engine at %s did not start again (%d in a row): %s", self.url,
                          num_failed, error)
                if num_failed >= MAX_FAILED_STARTS:
                    log.error("engine at %s is given up after %d failed restarts; the pool "
                              "serves on its other engines", self.url, num_failed)
                    return
                await asyncio.sleep(POLL_S * 2 ** num_failed)
                continue
            num_failed = 0
