"""The built-in inference engine: a Llama, Qwen2 or Qwen3 model served through SGLang's native
HTTP API.

`undertow engine serve --model DIR` starts it (`server.py`). The flow of one request:
`server.py` (HTTP, validation, tokenization) -> `scheduler.py` (one worker thread: admission,
prefix-cache lookup in `radix_cache.py`, prefill, one batched decode step for every running
request, sampling in `sampling.py`) -> `model.py` (the decoder's forward on a per-slot KV buffer;
`model_config.py` reads which family and refuses what it cannot run)
-> outputs flow back to the request's asyncio queue and out as JSON or SSE chunks.

This package's `__init__` imports nothing, so importing `undertow.gateway.engines.builtin`
never imports torch; only the modules below do, when the server starts.

Exceptions: `EngineError` (in `errors.py`) is the root; `BadRequest` is a client error the
server turns into HTTP 400, `WeightLoadError` a failed weight load.
"""
