"""Which parser a model directory's chat template calls for (`tool_parser=auto`).

A template writes its family's tool-call format itself (to render earlier calls and
to describe the tools), so its text names the format; the markers are checked from
the most to the least specific (Qwen3-Coder's template also writes `<tool_call>`).
"""

from __future__ import annotations

from pathlib import Path

from undertow.gateway.trees.template_env import read_chat_templates

MARKERS = (("harmony", ("<|channel|>",)),
           ("kimi_k2", ("<|tool_calls_section_begin|>",)),
           ("deepseek_v3", ("tool▁calls▁begin", "tool_calls_begin")),
           ("glm45", ("<arg_key>",)),
           ("qwen3_coder", ("<function=", "<parameter=")),
           ("hermes", ("<tool_call>",)),
           ("llama3_json", ("<|python_tag|>", "ipython")))


def parser_of_template(template: str) -> str:
    """The parser name for a chat template's text; `hermes` when nothing matches."""
    for name, markers in MARKERS:
        if any(marker in template for marker in markers):
            return name
    return "hermes"


def template_of(model_dir: Path) -> str:
    """The chat template text of a Hugging Face model directory, every named template
    joined (a `tool_use` template is where the tool-call format is written)."""
    return read_chat_templates(model_dir).text


def resolve_parser(name: str, model_dir: Path) -> str:
    """`name`, or for `auto` the parser that the model directory's template calls for."""
    return parser_of_template(template_of(model_dir)) if name == "auto" else name
