"""The built-in inference engine: a Llama, Qwen2 or Qwen3 model served through SGLang's native
HTTP API, a server in a process of its own (`server.py`, `undertow engine serve`). The flow
of a request through its modules: docs/engines.md, "The built-in engine". It imports nothing
of the gateway's drivers or pool, and this `__init__` nothing at all, so importing the package
never imports torch. Errors: `errors.py` draws them.
"""
