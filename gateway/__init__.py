"""The gateway: OpenAI/Anthropic-compatible HTTP API for unmodified scaffolds.

It renders each call to exact token IDs, drives inference engines through
SGLang's native protocol (`engines/`), and records every call into prefix trees.
Never imports torch at import time: only the built-in engine's server does, when started.
"""
