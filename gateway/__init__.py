"""The gateway: an OpenAI/Anthropic-compatible HTTP API for unmodified scaffolds, which
renders each call to exact token IDs, generates it on SGLang-protocol engines and records
it into prefix trees. Its packages, and what this root holds, are in docs/design.md,
"Layout".
"""
