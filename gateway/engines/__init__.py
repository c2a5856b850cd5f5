"""Engine drivers: one client for SGLang's native HTTP protocol, launchers, and the
engine pool that the front sends calls to (`pool.py`: routing, admission, in-flight calls,
draining, migration, weight updates). Never imports the front.

`builtin` is Undertow's own torch engine server (CPU), `sglang` a real SGLang
server, `vllm` a real vLLM server adapted to the same protocol.
"""
