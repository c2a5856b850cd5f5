"""Chat templates as `transformers` finds and renders them, without importing it. The
gateway's `render.Renderer`, the built-in engine's tokenizer and the learner's
`modeldir/chat_template.py` all read and render a model directory's templates here, so
that one template gives one text everywhere; each passes what a template's
`raise_exception(message)` raises: its own package's error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """`transformers`' `tojson` filter: `json.dumps`, non-ASCII text kept as it is."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def chat_template_environment(refuse: Callable[[str], NoReturn]
                              ) -> ImmutableSandboxedEnvironment:
    """A fresh environment whose templates' `raise_exception(message)` calls `refuse`,
    built as `apply_chat_template` builds it (sandboxed, `trim_blocks`, `lstrip_blocks`,
    loop controls, `tojson` keeping non-ASCII text, `strftime_now`)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined,
        extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = refuse
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment


CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class ChatTemplates:
    """A model directory's chat templates by name (`default`, `tool_use`, ...); empty
    when it has none. `source` says where they were read, for messages."""

    by_name: Mapping[str, str]
    source: str

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def select(self, with_tools: bool) -> str | None:
        """The template a call renders: `tool_use` for a call with tools when there is
        one, else `default` (None when the directory has no default), as
        `apply_chat_template` and vLLM choose."""
        if with_tools and "tool_use" in self.by_name:
            return self.by_name["tool_use"]
        return self.by_name.get("default")

    @property
    def text(self) -> str:
        """Every template's text, joined (what the tool-parser detection searches)."""
        return "\n".join(self.by_name.values())


def read_chat_templates(model_dir: Path) -> ChatTemplates:
    """The chat templates of a Hugging Face model directory, in `transformers`' order:
    `chat_template.jinja` (the default) and `additional_chat_templates/NAME.jinja` (what
    `save_pretrained` writes since transformers 4.5x); failing those, `chat_template` in
    `tokenizer_config.json`, a string or a list of `{"name", "template"}` entries.
    ValueError when that has a form no loader reads."""
    model_dir = Path(model_dir)
    by_name: dict[str, str] = {}
    default_file = model_dir / CHAT_TEMPLATE_FILE
    if default_file.is_file():
        by_name["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = model_dir / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            by_name[path.stem] = path.read_text(encoding="utf-8")
    if by_name:
        return ChatTemplates(by_name, f"{model_dir}/{CHAT_TEMPLATE_FILE}")
    config_file = model_dir / TOKENIZER_CONFIG
    source = f"{config_file} (chat_template)"
    if not config_file.is_file():
        return ChatTemplates({}, source)
    return ChatTemplates(_named_templates(
        json.loads(config_file.read_text(encoding="utf-8")).get("chat_template"), source), source)


def special_token_text(token) -> str | None:
    """A special token as `tokenizer_config.json` names it (`bos_token`, `eos_token`): its
    text, or the `content` of the older `AddedToken` object form."""
    return token.get("content") if isinstance(token, Mapping) else token


def _named_templates(value, source: str) -> dict[str, str]:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(item, Mapping) and isinstance(
            item.get("name"), str) and isinstance(item.get("template"), str) for item in value):
        return {item["name"]: item["template"] for item in value}
    raise ValueError(f"{source} is neither a template string nor a list of "
                     "{\"name\": ..., \"template\": ...} entries; fix it or write the "
                     f"template to {CHAT_TEMPLATE_FILE}")
