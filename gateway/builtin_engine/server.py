"""The built-in engine's HTTP server: SGLang's native API (v0.5.x semantics) plus OpenAI routes.

Follows SGLang 0.5.x (`python/sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`,
`sampling/sampling_params.py`): `POST /generate` takes `GenerateReqInput` fields and answers
`{text, output_ids, meta_info}`; `meta_info` has `id`, `finish_reason` (`{"type": "stop",
"matched": token_id | str}`, `{"type": "length", "length": n}`, `{"type": "abort", "message"}`),
`prompt_tokens`, `completion_tokens`, `cached_tokens`, `weight_version`, `e2e_latency` (when
finished) and, with `return_logprob`, `output_token_logprobs` as `[logprob, token_id, text]`
(text is null unless `return_text_in_logprobs`), `input_token_logprobs` from
`logprob_start_len` (-1, the default, asks for none; the first prompt token's logprob is null),
and the `*_top_logprobs` lists when `top_logprobs_num` > 0.

Streaming (`"stream": true`) is SSE: `data: {...}\\n\\n` per step and `data: [DONE]\\n\\n` at
the end. As in SGLang's default (`--incremental-streaming-output` off), every chunk carries the
cumulative `text`, `output_ids` and logprob lists so far, and `finish_reason` is null until the
last chunk; `EngineConfig.incremental_streaming_output` switches to deltas like SGLang's flag.
`output_ids` keep a matched stop token; `text` drops it and a matched stop string (unless
`no_stop_trim`). Errors are HTTP 400 with `{"error": {"message", "type", "code"}}`.

`serve(config)` runs it; with port 0 it prints `undertow engine listening on http://HOST:PORT`.
"""

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from aiohttp import web

from undertow.gateway.builtin_engine import native_api, openai_api, undertow_kv
from undertow.gateway.builtin_engine.errors import BadRequest
from undertow.gateway.builtin_engine.grammar import Grammars
from undertow.gateway.builtin_engine.memory import keep_freed_memory
from undertow.gateway.builtin_engine.model import (
    DEVICES,
    DTYPES,
    CausalLM,
    load_weights,
    resolve_device,
    resolve_dtype,
)
from undertow.gateway.builtin_engine.model_config import ModelConfig
from undertow.gateway.builtin_engine.radix_cache import RadixCache
from undertow.gateway.builtin_engine.request import Request
from undertow.gateway.builtin_engine.scheduler import Scheduler, Update
from undertow.gateway.builtin_engine.tokenizer import Tokenizer
from undertow.gateway.kv_wire import KV_TRANSFER

SGLANG_API_VERSION = "0.5.x"


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one built-in engine server.

    `cache_bytes` bounds the prefix cache's KV (the running requests' own KV comes on top);
    `num_threads` sets torch's intra-op threads (None keeps torch's default); `context_length`
    may lower the model's `max_position_embeddings`; `chunked_prefill_size` bounds one prefill
    chunk, in token equivalents (`scheduler.py`; 0 or less prefills every prompt whole).
    `device` ("auto": CUDA when torch sees a GPU) holds the weights and the KV, in `dtype`
    ("auto": bfloat16 on CUDA, float32 on the CPU; `model.py`).
    """

    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    max_running_requests: int = 64
    cache_bytes: int = 256 * 2**20
    weight_version: str = "0"
    num_threads: int | None = None
    served_model_name: str | None = None
    context_length: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 256
    incremental_streaming_output: bool = False
    device: str = "cpu"
    dtype: str = "auto"

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} must be one of {DEVICES}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be 'auto' or one of {sorted(DTYPES)}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests={self.max_running_requests} must be >= 1")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes={self.cache_bytes} must be >= 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads} must be >= 1")


class BuiltinEngine:
    """Tokenizer, model, scheduler, and the bridge from the worker thread to the event loop."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path = str(config.model_dir)
        self.tokenizer = Tokenizer(config.model_dir)
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        model = CausalLM(self.model_config, load_weights(config.model_dir, self.model_config,
                                                      self.device, self.dtype))
        self.context_length = min(config.context_length or 1 << 62,
                                  self.model_config.max_position_embeddings)
        self.served_model_name = config.served_model_name or self.model_path
        self.cache = RadixCache(config.cache_bytes)
        self.scheduler = Scheduler(
            model, self.cache, self.tokenizer.decode,
            self.tokenizer.eos_token_ids | frozenset(self.model_config.eos_token_ids),
            config.max_running_requests, self._publish, config.weight_version,
            max_prefill_tokens=config.max_prefill_tokens,
            chunked_prefill_size=config.chunked_prefill_size)
        self.grammars = Grammars(config.model_dir, self.model_config.vocab_size,
                                 self.scheduler.eos_token_ids)
        self._queues: dict[Request, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.scheduler.start()

    async def close(self) -> None:
        await asyncio.to_thread(self.scheduler.stop)

    async def command(self, fn):
        """Run `fn` on the worker thread between two steps and return its result."""
        return await asyncio.wrap_future(self.scheduler.call(fn))

    def _publish(self, updates: list[Update]) -> None:
        assert self._loop is not None  # `start` set it before the scheduler ran
        self._loop.call_soon_threadsafe(self._deliver, updates)

    def _deliver(self, updates: list[Update]) -> None:
        for request, num_tokens, finished in updates:
            queue = self._queues.get(request)
            if queue is not None:
                queue.put_nowait((num_tokens, finished))

    async def updates(self, request: Request) -> AsyncGenerator[tuple[int, bool], None]:
        """Submit `request`; yield (number of output tokens, finished) as it progresses, skipping
        stale intermediate states. Leaving early (client gone) aborts the request."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request] = queue
        self.scheduler.add(request)
        try:
            while True:
                num_tokens, finished = await queue.get()
                while not finished and not queue.empty():
                    num_tokens, finished = queue.get_nowait()
                yield num_tokens, finished
                if finished:
                    return
        finally:
            self._queues.pop(request, None)
            if request.finish_reason is None:
                self.scheduler.call(lambda: self.scheduler.abort(
                    None, "Abort: the client disconnected", request=request))

    async def run(self, request: Request) -> int:
        """Submit `request` and wait until it finishes; return its number of output tokens."""
        num_tokens = 0
        async with contextlib.aclosing(self.updates(request)) as updates:
            async for update in updates:
                num_tokens = update[0]
        return num_tokens

    def load(self) -> dict:
        running = list(self.scheduler.running)
        return {
            "num_running_reqs": len(running),
            "num_waiting_reqs": self.scheduler.num_waiting,
            "num_used_tokens": sum(r.kv_length for r in running),
            "num_cached_tokens": self.cache.num_tokens,
            "num_staged_tokens": sum(e.num_tokens for e in list(self.scheduler.staged.entries)),
            "cache_bytes_used": self.cache.num_bytes,
            "paused": self.scheduler.paused,
            "num_decode_steps": self.scheduler.num_steps,
        }

    def server_info(self) -> dict:
        info = {key: str(value) if isinstance(value, Path) else value
                for key, value in asdict(self.config).items()}
        info.update(device=str(self.device), dtype=str(self.dtype).removeprefix("torch."))
        load = self.load()
        info.update(load)
        info.update({
            "model_path": self.model_path, "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name, "context_length": self.context_length,
            "max_req_input_len": self.context_length - 1,
            "weight_version": self.weight_version, "internal_states": [load],
            "version": f"undertow-builtin (SGLang {SGLANG_API_VERSION} API)",
            "undertow_extensions": [KV_TRANSFER],
            # as SGLang reports it: a seeded request samples the same tokens in any batch
            # (`sampling.py`), so a recorded seed replays
            "enable_deterministic_inference": True,
        })
        return info


def error_response(message: str, status: int = 400) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status=status)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as error:
        return error_response(str(error))
    except json.JSONDecodeError as error:
        return error_response(f"the body is not valid JSON: {error}")


def build_app(engine: BuiltinEngine) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=256 * 2**20)
    app["engine"] = engine
    native_api.add_routes(app, engine)
    openai_api.add_routes(app, engine)
    undertow_kv.add_routes(app, engine)

    async def on_startup(_app):
        await engine.start()

    async def on_cleanup(_app):
        await engine.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def _serve(config: EngineConfig) -> None:
    engine = BuiltinEngine(config)
    runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"undertow engine listening on http://{config.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def serve(config: EngineConfig) -> None:
    """Run the engine server until SIGINT or SIGTERM."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    keep_freed_memory()
    asyncio.run(_serve(config))
