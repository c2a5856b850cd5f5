"""Engine drivers: one client for SGLang's native HTTP protocol, and launchers.

`builtin` is Undertow's own torch engine server (CPU), `sglang` a real SGLang
server, `vllm` a real vLLM server adapted to the same protocol.
"""
