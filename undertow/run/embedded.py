"""Engine and gateway started for one run: the rollout command's default ("embedded").

`embedded_gateway(model_dir, store_dir)` starts the built-in engine on the model (unless
engine URLs are given; kept serving by `engine_keeper.py`) and serves the gateway in this
process, on a free port of 127.0.0.1 with a fresh admin token unless told otherwise, for
`undertow rollout`, `train` and `serve`. `held_on(loop, manager)` is how the sync run
holds such services: entered and exited on its background thread's asyncio loop.
"""

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EmbeddedGateway:
    """The gateway's URL and admin token, its engines, and of those the ones Undertow
    launched (`launched_urls`: restarted when they die, `engine_keeper.py`)."""

    url: str
    admin_token: str
    engine_urls: tuple[str, ...]
    launched_urls: tuple[str, ...] = ()


@contextlib.asynccontextmanager
async def serve_gateway(model_dir: Path, store_dir: Path, engine_urls: Sequence[str],
                        admin_token: str = "", **config: Any) -> AsyncIterator[EmbeddedGateway]:
    """The gateway, in this process, in front of `engine_urls`; `config` holds any other
    `GatewayConfig` fields (`host` and `port` default to 127.0.0.1 and a free port), and
    an empty `admin_token` is replaced by a fresh one."""
    from aiohttp import web

    from undertow.gateway.front.app import create_app
    from undertow.gateway.front.config import GatewayConfig

    token = admin_token or secrets.token_hex(16)
    gateway_config = GatewayConfig(model_dir=Path(model_dir), store_dir=Path(store_dir),
                                   engine_urls=tuple(engine_urls), admin_token=token, **config)
    runner = web.AppRunner(create_app(gateway_config), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, gateway_config.host, gateway_config.port)
        await site.start()
        url = f"http://{gateway_config.host}:{runner.addresses[0][1]}"
        yield EmbeddedGateway(url, token, tuple(engine_urls))
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def embedded_gateway(model_dir: Path, store_dir: Path,
                           engine_urls: Sequence[str] = (), **config: Any
                           ) -> AsyncIterator[EmbeddedGateway]:
    """The gateway, and the built-in engine on `model_dir` when no engine URL is given
    (kept serving: started again on its port should it die, `engine_keeper.KeptEngine`)."""
    from undertow.gateway.engines.launch import BuiltinLauncher
    from undertow.run.engine_keeper import KeptEngine

    async with contextlib.AsyncExitStack() as stack:
        launched: tuple[str, ...] = ()
        if not engine_urls:
            engine = await KeptEngine.start(BuiltinLauncher(), Path(model_dir),
                                            Path(store_dir).parent / "engine.log")
            stack.push_async_callback(engine.stop)
            engine_urls = launched = (engine.url,)
        gateway = await stack.enter_async_context(
            serve_gateway(model_dir, store_dir, engine_urls, **config))
        yield replace(gateway, launched_urls=launched)


@contextlib.contextmanager
def held_on(loop: asyncio.AbstractEventLoop, manager: contextlib.AbstractAsyncContextManager
            ) -> Iterator[Any]:
    """What async `manager` gives (`embedded_gateway`, `serve_gateway`), entered on `loop`,
    which runs in another thread, and exited there when the block ends, even on an error;
    for sync code that must not block that loop."""
    value = asyncio.run_coroutine_threadsafe(manager.__aenter__(), loop).result()
    try:
        yield value
    except BaseException as error:
        exit_ = manager.__aexit__(type(error), error, error.__traceback__)
        if not asyncio.run_coroutine_threadsafe(exit_, loop).result():
            raise
    else:
        asyncio.run_coroutine_threadsafe(manager.__aexit__(None, None, None), loop).result()
