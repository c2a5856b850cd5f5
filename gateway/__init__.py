"""The gateway: OpenAI/Anthropic-compatible HTTP API for unmodified scaffolds.

Three packages (docs/design.md, "Layout"): `front/` renders each call to exact token IDs and
records it into prefix trees; `engines/` drives inference engines through SGLang's native
protocol, pools them and serves the built-in one; `trees/` is the tree data model, all the
learner imports. At this root, what the three share: `errors.py`, `metrics.py`, `malloc.py`,
and `render.py` (a model directory's chat template and tokenizer, which the scripted engine
decodes with too). Never imports torch at import time: only the built-in engine's server does,
when started.
"""
