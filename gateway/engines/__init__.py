"""Engine drivers and launchers: the drivers of the engine protocols (`protocol.py`) for
SGLang's native HTTP API (`sglang.py`, which the built-in engine speaks too) and vLLM
(`vllm.py`), the scripted engines of tests, and the launchers with their supervisor. The
engine pool drives engines through them (docs/engines.md). Never imports the front, the
engine pool or the built-in engine."""
