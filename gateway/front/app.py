"""The gateway's aiohttp application, the composition root of `gateway/`: `create_app(config)`
wires, once per process, the metrics, the tree store (replayed from disk), the renderer, the
engine pool, the call runner and the routes (docs/design.md, "Gateway API"); `serve(config)`
runs it and prints the URL it listens on (port 0 picks one).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from pathlib import Path

from aiohttp import web

from undertow.gateway import malloc
from undertow.gateway.engines.drivers import driver_for_url
from undertow.gateway.front.api import (
    admin,
    anthropic_messages,
    models,
    openai_chat,
    openai_completions,
    responses,
)
from undertow.gateway.front.api.common import client_left
from undertow.gateway.front.api.errors import REPLY_STATUS_KEY, error_middleware
from undertow.gateway.front.auto_sessions import AutoSessions
from undertow.gateway.front.calls import CallRunner, model_vocab_size
from undertow.gateway.front.config import GatewayConfig
from undertow.gateway.front.head_replay import HeadReplay
from undertow.gateway.front.sessions import SessionRegistry
from undertow.gateway.front.store import TreeStore
from undertow.gateway.front.toolparsers import resolve_parser
from undertow.gateway.metrics import GatewayMetrics
from undertow.gateway.render import Renderer

_API_NAMES = (("/v1/chat/completions", "chat"), ("/v1/completions", "completions"),
              ("/v1/messages/count_tokens", "count_tokens"), ("/v1/messages", "messages"),
              ("/v1/responses", "responses"), ("/v1/models", "models"))

GC_THRESHOLD_ALLOCATIONS = 50_000
TRIM_THRESHOLD_BYTES = 64 * 2**20
METRICS_KEY = web.AppKey("metrics", GatewayMetrics)
STORE_KEY = web.AppKey("store", TreeStore)
SESSIONS_KEY = web.AppKey("sessions", SessionRegistry)
RUNNER_KEY = web.AppKey("runner", CallRunner)
POOL_KEY = web.AppKey("pool", object)
AUTO_SESSIONS_KEY = web.AppKey("auto_sessions", AutoSessions)


def context_length_of(model_dir: Path, renderer: Renderer, configured: int) -> int:
    if configured:
        return configured
    limits = [renderer.max_length] if renderer.max_length else []
    config_file = Path(model_dir) / "config.json"
    if config_file.exists():
        value = json.loads(config_file.read_text()).get("max_position_embeddings")
        limits += [int(value)] if value else []
    if not limits:
        raise ValueError(f"{model_dir} states no context length; set context_length")
    return min(limits)


def _metrics_middleware(metrics: GatewayMetrics):
    """Counts each scaffold call by API and the status its client effectively got (a
    stream that an error event ended counts with the error's status, `REPLY_STATUS_KEY`,
    not its head's 200), or as a client disconnect when its client left before the reply's
    end (`client_left`): a client's choice, no 5xx."""
    @web.middleware
    async def record(request: web.Request, handler):
        api = next((name for suffix, name in _API_NAMES if request.path.endswith(suffix)), None)
        started_s = time.perf_counter()
        status, response = 500, None
        try:
            response = await handler(request)
            status = request.get(REPLY_STATUS_KEY, response.status)
            return response
        except web.HTTPException as error:
            status = error.status
            raise
        finally:
            if api is not None and client_left(request, response):
                metrics.client_disconnects.inc(api=api)
            elif api is not None:
                metrics.calls.inc(api=api, status=str(status))
                metrics.call_duration_s.observe(time.perf_counter() - started_s, api=api)
    return record


def create_app(config: GatewayConfig, pool=None) -> web.Application:
    """The application; `pool` replaces the engine pool built from `config.engine_urls`
    (tests give their own pool object with the same `generate`/`close_session`)."""
    from undertow.gateway.engine_pool.pool import EnginePool, PoolConfig
    from undertow.gateway.front.api.engines_admin import add_engine_routes

    metrics = GatewayMetrics.create()
    renderer = Renderer(config.model_dir)
    sessions = SessionRegistry(config.num_heads_per_session)
    store = TreeStore(config.store_dir, sync=config.store_sync,
                      max_idle_trees=config.store_max_idle_trees, is_active=sessions.has_open,
                      metrics=metrics, hold_max_bytes=config.store_hold_max_bytes,
                      hold_max_s=config.store_hold_max_s)
    sessions.on_group_idle = store.group_idle  # its last session closed: maybe let it go
    tool_parser = resolve_parser(config.tool_parser, config.model_dir)
    heads = HeadReplay(renderer, sessions, tool_parser)
    for event in store.replay():
        if event["kind"] == "call":
            heads.apply(event, store.tree(event["group"]))
        else:
            sessions.restore(event)
    heads.finish()
    metrics.open_sessions.set(sessions.num_open)
    own_pool = pool is None
    pool = (EnginePool(config.engine_urls, PoolConfig(router=config.router), metrics=metrics,
                       driver_factory=driver_for_url) if own_pool else pool)
    runner = CallRunner(pool=pool, store=store, renderer=renderer, sessions=sessions,
                        metrics=metrics, vocab_size=model_vocab_size(config.model_dir),
                        context_length=context_length_of(config.model_dir, renderer,
                                                         config.context_length),
                        default_max_tokens=config.default_max_tokens,
                        tool_parser=tool_parser, token_truth=config.token_truth)
    middlewares = [_metrics_middleware(metrics), error_middleware]
    auto = None
    if config.auto_sessions is not None:
        auto = AutoSessions(config.auto_sessions, sessions, store, pool, metrics)
        middlewares.append(auto.middleware)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[METRICS_KEY], app[STORE_KEY], app[SESSIONS_KEY] = metrics, store, sessions
    app[RUNNER_KEY], app[POOL_KEY] = runner, pool
    if auto is not None:
        app[AUTO_SESSIONS_KEY] = auto
        app.cleanup_ctx.append(auto.checks)

    admin_auth = admin.make_admin_auth(config.admin_token)
    openai_chat.add_routes(app, runner, sessions, config)
    openai_completions.add_routes(app, runner, sessions, config)
    anthropic_messages.add_routes(app, runner, sessions, config)
    responses.add_routes(app, runner, sessions, config)
    models.add_routes(app, sessions, config)
    admin.add_routes(app, sessions, store, pool, metrics, admin_auth)
    add_engine_routes(app, pool, admin_auth)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "num_sessions": len(sessions)})

    async def metrics_page(request: web.Request) -> web.Response:
        return web.Response(body=metrics.registry.render().encode(),
                            headers={"Content-Type": metrics.registry.CONTENT_TYPE})

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_page)

    async def on_startup(app: web.Application) -> None:
        await store.start()
        if own_pool:
            await pool.start()

    async def on_cleanup(app: web.Application) -> None:
        if own_pool:
            await pool.close()
        await store.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def _serve_forever(config: GatewayConfig) -> None:
    app = create_app(config)
    gc.collect()
    gc.freeze()  # the replayed trees: see `tune_gc`
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"undertow gateway listening on http://{config.host}:{port}", flush=True)
    if config.auto_sessions is not None:
        print(config.auto_sessions.describe(), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def tune_gc() -> None:
    """Makes the garbage collector cheap for a process that holds long lists of token IDs.

    A call's prompt is a list of up to context-length IDs, alive while it runs;
    CPython's young-generation collection runs every 700 net allocations of containers
    (parsing one request's messages makes hundreds) and traverses every element of each
    young list, so at 128k tokens of history collections took about a fifth of the
    gateway's CPU per call (perf). Collecting every 50,000 allocations makes that
    negligible; the objects alive once the store is replayed (its trees) are frozen, so
    no collection traverses them again. Memory held by garbage cycles is freed a little
    later; nothing else changes. It is process-wide, so only the gateway's own process
    (`serve`) calls it; a process that embeds the gateway decides for itself."""
    gc.set_threshold(GC_THRESHOLD_ALLOCATIONS, *gc.get_threshold()[1:])


def tune_malloc() -> bool:
    """Makes glibc's malloc keep the memory of freed request bodies for the next ones.

    A long session re-sends its history on every call: at a million tokens each body is
    3.5 MB, read by aiohttp into a growing buffer and copied once more, and the prompt's
    IDs are 3.8 MB of JSON. By default glibc maps a block that large on its own (its mmap
    threshold rises only to the largest block freed so far) and gives the top of the heap
    back to the system past twice that, so every call mapped, zero-filled and faulted in
    fresh pages: 700-900 minor page faults a call at 600k tokens in `benchmarks/xlong.py`
    part (d). With blocks up to 32 MiB taken from the heap and up to 64 MiB of free heap
    kept, 14 a call, for 1.2 ms less CPU a call there and ~6 MiB more RSS (at most 64 MiB
    more). Returns whether it applied: nothing happens where the C library is not glibc.
    Process-wide, like `tune_gc`, so only the gateway's own process (`serve`) calls it."""
    return malloc.keep_freed(TRIM_THRESHOLD_BYTES)


def event_loop_factory():
    """uvloop's event loop where it is installed (a dependency except on Windows), else
    asyncio's.

    Much of the gateway's CPU per call is the event loop and the socket transports (it
    relays every call between two HTTP connections); uvloop runs those in C (about
    0.1 ms less CPU per call in `benchmarks/gateway.py`'s latency part). The semantics
    are asyncio's; only the loop's implementation changes."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def serve(config: GatewayConfig) -> None:
    """Runs the gateway until interrupted."""
    tune_gc()
    tune_malloc()
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(
            loop_factory=event_loop_factory()) as runner:
        runner.run(_serve_forever(config))
