"""The Messages API's request options that are not messages or tools, read into what
the gateway honours: `thinking` and `output_config.effort` as template arguments,
`thinking.display`, `context_management` edits, and `output_config.format` /
`output_format` as a JSON schema (`anthropic_messages.py` applies them; the README's
"Request fields" table lists each, honoured or refused)."""

from __future__ import annotations

from typing import Any

from undertow.gateway.errors import BadRequest, UnsupportedParameter
from undertow.gateway.front.api.output_options import check_value, known_keys

EFFORTS = ("low", "medium", "high", "xhigh", "max")
KEEP_ALL_THINKING = {"type": "clear_thinking_20251015", "keep": "all"}


def template_kwargs_of(body: dict[str, Any]) -> dict | None:
    """`thinking` as the template's `enable_thinking` (Qwen3's and GLM-4.5's name), and
    `output_config.effort` as its `reasoning_effort` (gpt-oss's name; passed as chat's
    `reasoning_effort` is, also to templates that do not read it: Claude Code sends it
    on every call). `budget_tokens` is not enforced: the reasoning is bounded by
    `max_tokens` only (see the README's "Request fields")."""
    kwargs = {}
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise BadRequest("thinking.type must be 'enabled', 'disabled' or 'adaptive'",
                             param="thinking")
        known_keys(thinking, {"type", "budget_tokens", "display"}, "thinking")
        check_value(thinking.get("display"), ("summarized", "omitted"), "thinking.display",
                    "the thinking is either shown or omitted")
        kwargs["enable_thinking"] = kind != "disabled"
    effort = known_keys(body.get("output_config"), {"effort", "format"},
                        "output_config").get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise BadRequest(f"output_config.effort must be one of {list(EFFORTS)}, got "
                             f"{effort!r}", param="output_config")
        kwargs["reasoning_effort"] = effort
    return kwargs or None


def check_context_management(value: Any) -> None:
    """Context editing: the gateway keeps every earlier thinking block (token truth
    reuses the sampled IDs, reasoning included), which is what `clear_thinking` with
    `keep: "all"` (Claude Code's edit) asks. It applies no other edit: clearing earlier
    thinking or tool results would change a history token truth reuses verbatim, so
    every call past the edit would render in full as a `rewrite`; a scaffold that needs
    it clears its own history (as context condensation does)."""
    edits = known_keys(value, {"edits"}, "context_management").get("edits") or []
    if not isinstance(edits, list):
        raise BadRequest("context_management.edits must be a list", param="context_management")
    for index, edit in enumerate(edits):
        if edit != KEEP_ALL_THINKING:
            raise UnsupportedParameter(
                f"context_management.edits.{index}: {edit!r} cannot be honoured: the gateway "
                "keeps its history as sampled and applies no context edit other than "
                f"{KEEP_ALL_THINKING}; clear old tool results or thinking in the scaffold",
                param="context_management")


def output_schema(body: dict[str, Any]) -> tuple[str, Any] | None:
    """The field and JSON schema of `output_config.format` (or the older
    `output_format`), or None."""
    formats = [(name, fmt) for name, fmt in (
        ("output_config.format", (body.get("output_config") or {}).get("format")),
        ("output_format", body.get("output_format"))) if fmt is not None]
    if not formats:
        return None
    if len(formats) > 1:
        raise BadRequest("send output_config.format or output_format, not both",
                         param="output_format")
    name, fmt = formats[0]
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise UnsupportedParameter(f"{name}.type must be 'json_schema'", param=name)
    return name, fmt.get("schema")


def thinking_omitted(body: dict[str, Any]) -> bool:
    """Whether thinking blocks are to come back empty, sealed in their signature."""
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("display") == "omitted"
