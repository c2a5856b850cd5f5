"""The viewer's HTTP server (aiohttp): the static page, the JSON it reads (the routes are
in docs/commands.md) and, with a gateway, server-sent events of its open sessions.

Any failure answers JSON `{"error": ...}` with status 500, so that the page shows it. The
gateway's admin token stays in this process (sent to the gateway only, in the
`Authorization` header). File reads run in a worker thread, so that a large run never
stalls the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from undertow.ui import views
from undertow.ui.runs import Catalog, NotFoundError, RunFolder

log = logging.getLogger(__name__)
STATIC_DIR = Path(__file__).parent / "static"
JSON_OPTIONS = orjson.OPT_NON_STR_KEYS
MAX_CALLS_PER_PAGE = 100


@dataclass(frozen=True)
class ViewerConfig:
    """`undertow ui`: what to show, where to listen. `port` 0 picks a free port."""

    runs_dir: Path
    store_dir: Path | None = None
    gateway_url: str | None = None
    admin_token: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    poll_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.gateway_url and not self.admin_token:
            raise ValueError("--gateway needs the gateway's admin token in "
                             "UNDERTOW_ADMIN_TOKEN (it is never put in a URL)")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive, got {self.poll_interval_s}")


class Viewer:
    """The routes' handlers over one `Catalog`."""

    def __init__(self, config: ViewerConfig):
        self.config = config
        self.catalog = Catalog(config.runs_dir, config.store_dir)
        self.http: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_as_json])
        app.router.add_get("/", self.index)
        app.router.add_static("/static/", STATIC_DIR)
        routes = {"/api/info": self.info, "/api/runs": self.runs, "/api/runs/{run}": self.run,
                  "/api/runs/{run}/steps/{step}": self.step,
                  "/api/runs/{run}/groups/{group}/tree": self.tree,
                  "/api/runs/{run}/groups/{group}/sessions/{session}": self.session,
                  "/api/live": self.live}
        for path, handler in routes.items():
            app.router.add_get(path, handler)
        app.on_cleanup.append(self._close_http)
        return app

    async def index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    async def info(self, request: web.Request) -> web.Response:
        return _json({"runs_dir": str(self.config.runs_dir),
                                  "store_dir": str(self.config.store_dir or ""),
                                  "live": bool(self.config.gateway_url),
                                  "gateway": self.config.gateway_url or ""})

    async def runs(self, request: web.Request) -> web.Response:
        def read() -> dict[str, Any]:
            self.catalog.refresh()
            return {"runs": [_summary(run) for run in self.catalog.runs.values()],
                    "problems": self.catalog.problems()}
        return _json(await asyncio.to_thread(read))

    async def run(self, request: web.Request) -> web.Response:
        def read() -> dict[str, Any]:
            run = self.catalog.run(request.match_info["run"])
            records, _ = run.metrics()
            return {**run.summary(), "config": run.config(), "metrics": records,
                    "groups": run.groups(), "cell_timeline": run.cell_timeline()}
        return _json(await asyncio.to_thread(read))

    async def step(self, request: web.Request) -> web.Response:
        step = _int(request.match_info["step"], "step")
        run = self.catalog.run(request.match_info["run"])
        return _json(await asyncio.to_thread(views.step_view, run, step))

    async def tree(self, request: web.Request) -> web.Response:
        run = self.catalog.run(request.match_info["run"])
        return _json(
            await asyncio.to_thread(views.tree_view, run, request.match_info["group"]))

    async def session(self, request: web.Request) -> web.Response:
        run = self.catalog.run(request.match_info["run"])
        offset = max(0, _int(request.query.get("offset", "0"), "offset"))
        limit = _int(request.query.get("limit", str(views.CALLS_PER_PAGE)), "limit")
        limit = min(max(1, limit), MAX_CALLS_PER_PAGE)
        info = request.match_info
        return _json(await asyncio.to_thread(
            views.session_view, run, info["group"], info["session"], offset, limit))

    async def live(self, request: web.Request) -> web.StreamResponse:
        if not self.config.gateway_url:
            raise NotFoundError("live view is off: start `undertow ui` with --gateway URL "
                                "(and UNDERTOW_ADMIN_TOKEN)")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        # The page going away ends the stream (a reset write, or aiohttp cancelling us).
        with contextlib.suppress(ConnectionResetError):
            while True:
                event = await self._gateway_sessions()
                await response.write(f"event: sessions\ndata: {json.dumps(event)}\n\n".encode())
                await asyncio.sleep(self.config.poll_interval_s)
        return response

    async def _gateway_sessions(self) -> dict[str, Any]:
        """The gateway's open sessions now, or what went wrong asking."""
        if self.config.gateway_url is None:
            return {"error": "no gateway: start the viewer with --gateway URL", "sessions": []}
        if self.http is None:
            self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        url = f"{self.config.gateway_url.rstrip('/')}/admin/sessions"
        headers = {"Authorization": f"Bearer {self.config.admin_token}"}
        try:
            async with self.http.get(url, headers=headers) as reply:
                if reply.status != 200:
                    return {"error": f"the gateway answered {reply.status}: "
                                     f"{(await reply.text())[:300]}", "sessions": []}
                sessions = (await reply.json())["sessions"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as error:
            return {"error": f"the gateway at {self.config.gateway_url} could not be read: "
                             f"{type(error).__name__}: {error}", "sessions": []}
        return {"error": "", "sessions": [
            {k: s.get(k) for k in ("session_id", "group", "num_calls", "closed", "reward")}
            for s in sessions if not s.get("closed")]}

    async def _close_http(self, app: web.Application) -> None:
        if self.http is not None:
            await self.http.close()


def _summary(run: RunFolder) -> dict[str, Any]:
    """The run's row in the runs list. A run whose files this version cannot read is listed
    with what went wrong, so that one bad run never hides the others."""
    try:
        return run.summary()
    except Exception as error:  # any failure is this run's, shown in its row
        log.exception("run %s could not be read", run.name)
        return {"name": run.name, "path": str(run.path), "status": "unreadable",
                "num_steps": 0, "num_groups": 0,
                "problems": [f"the viewer could not read this run ({type(error).__name__}: "
                             f"{error}); its log has the details"]}


def _json(data: object, status: int = 200) -> web.Response:
    """A JSON answer (orjson: a page of thousands of tokens encodes in milliseconds)."""
    return web.Response(body=orjson.dumps(data, option=JSON_OPTIONS), status=status,
                        content_type="application/json")


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"{name} must be an integer, "
                                                           f"got {text!r}"}),
                                 content_type="application/json") from None


@web.middleware
async def _errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except NotFoundError as error:
        return _json({"error": str(error)}, status=404)
    except web.HTTPException:
        raise
    except Exception as error:  # the page shows it, not a bare 500
        log.exception("%s failed", request.path)
        return _json({"error": f"the viewer failed on {request.path}: "
                               f"{type(error).__name__}: {error} (its log has the details)"},
                     status=500)


async def serve(config: ViewerConfig, ready: Callable[[str], None] | None = None) -> None:
    """Serves until cancelled; `ready(url)` is called once listening (port 0 read back)."""
    runner = web.AppRunner(Viewer(config).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://{config.host}:{port}"
    print(f"undertow ui: {url} (runs {config.runs_dir})", flush=True)
    if ready is not None:
        ready(url)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
