"""The one Jinja environment chat templates are rendered in, built as `transformers`'
`apply_chat_template` builds it (sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls,
`tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`), without importing it.

Three renderers use it, so that one template gives one text everywhere: the gateway's
`render.Renderer` (a session's prompt), the built-in engine's tokenizer
(`engines/builtin/tokenizer.py`, its own `/v1/chat/completions`), and the learner's
template of the models it builds (`learner/modeldir/chat_template.py`). Each passes what a
template's `raise_exception(message)` raises: its own package's error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """`transformers`' `tojson` filter: `json.dumps`, non-ASCII text kept as it is."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def chat_template_environment(refuse: Callable[[str], NoReturn]
                              ) -> ImmutableSandboxedEnvironment:
    """A fresh environment whose templates' `raise_exception(message)` calls `refuse`."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined,
        extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = refuse
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment
