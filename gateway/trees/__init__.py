"""The tree data model, all that the learner imports of the gateway (docs/design.md,
"Layout"): prefix trees of token IDs (`tree.py`), their exception root (`errors.py`), and the
chat-template environment that the gateway, the built-in engine and the learner render a model
directory's templates in (`template_env.py`). Imports nothing else of the gateway.
"""
