"""Structured output for the built-in engine: SGLang's `json_schema`, `regex`, `ebnf` and
`structural_tag` sampling parameters enforced with xgrammar (the grammar library SGLang itself
uses by default), as a mask on the logits.

`Grammars` compiles a request's constraint once (compiled grammars are cached by their
text, so an agent's repeated tool schema compiles once) and gives the request a
`GrammarState`. At each step the scheduler masks the logits of constrained rows to the
tokens the grammar allows (`mask_logits`), samples, and advances each state by the token
drawn (`GrammarState.accept`). When the grammar is complete only the stop tokens remain
allowed, so the request ends with one of them.

JSON schemas compile without free whitespace (`any_whitespace=False`): the output is
compact JSON, so a model cannot spend its token budget on blank space inside the object.

A `structural_tag` is read as SGLang 0.5.23 reads it (`XGrammarGrammarBackend.
dispatch_structural_tag`): xgrammar's format (`{"type": "structural_tag", "format": ...}`), or
the legacy one (`structures` of begin/schema/end, `triggers`, `at_least_one`), which becomes
xgrammar's triggered tags; a missing JSON schema is any JSON. The gateway sends one to force
a tool call in the model's own syntax (`front/toolparsers/forced.py`).
xgrammar (and transformers, for the vocabulary) are imported on the first constrained
request, so that an engine that never sees one starts as fast as before.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from undertow.gateway.builtin_engine.errors import BadRequest

if TYPE_CHECKING:
    import xgrammar


class GrammarState:
    """One request's position in its grammar. Invariant: every sampled output token was
    accepted, in order; a state whose grammar is complete allows only stop tokens."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False if the grammar did not allow it."""
        return self._matcher.is_terminated() or self._matcher.accept_token(token_id)


def structural_tag_of(text: str) -> xgrammar.StructuralTag:
    """A `structural_tag` sampling parameter as xgrammar's structural tag, legacy or not,
    as SGLang 0.5.23 converts it; BadRequest when it is neither."""
    import xgrammar

    try:
        tag = json.loads(text)
    except json.JSONDecodeError as error:
        raise BadRequest(f"sampling_params.structural_tag is not JSON: {error}") from None
    if not isinstance(tag, dict) or not (isinstance(tag.get("format"), dict)
                                         or isinstance(tag.get("structures"), list)):
        raise BadRequest("sampling_params.structural_tag must be an object with a 'format' "
                         "(xgrammar's structural tag) or 'structures' and 'triggers' (the "
                         "legacy form)")
    if "format" in tag:
        _fill_schemas(tag["format"])
        return xgrammar.StructuralTag.model_validate(tag)
    items = [xgrammar.StructuralTagItem(begin=item["begin"], end=item["end"],
                                        schema=json.dumps(item.get("schema") or {}))
             for item in tag["structures"]]
    legacy = xgrammar.StructuralTag.from_legacy_structural_tag(items, tag.get("triggers") or [])
    legacy.format.at_least_one = bool(tag.get("at_least_one", False))  # type: ignore[union-attr]
    return legacy


def _fill_schemas(fmt) -> None:
    """A `json_schema` format without its schema is any JSON, as in SGLang (in place)."""
    if not isinstance(fmt, dict):
        return
    if fmt.get("type") == "json_schema" and fmt.get("json_schema") is None:
        fmt["json_schema"] = {}
    for child in [fmt.get("content"), *fmt.get("elements", ()), *fmt.get("tags", ())]:
        _fill_schemas(child)


class Grammars:
    """Compiles constraints for one model directory's tokenizer (thread-safe: compiling
    runs off the event loop, the scheduler only uses finished states)."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: frozenset[int]):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._compiled: dict[tuple[str, str], xgrammar.CompiledGrammar] = {}
        self._lock = threading.Lock()

    def _compile(self, kind: str, text: str) -> xgrammar.CompiledGrammar:
        import xgrammar

        if self._compiler is None:
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast(
                tokenizer_file=str(self.model_dir / "tokenizer.json"))
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        if kind == "json_schema":
            try:
                json.loads(text)
            except json.JSONDecodeError as error:
                raise BadRequest(f"sampling_params.json_schema is not JSON: {error}") from None
            return self._compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return self._compiler.compile_regex(text)
        if kind == "structural_tag":
            return self._compiler.compile_structural_tag(structural_tag_of(text))
        return self._compiler.compile_grammar(text)

    def state(self, constraint: tuple[str, str]) -> GrammarState:
        """A fresh state for `(kind, text)`; BadRequest naming the field if it is invalid."""
        import xgrammar

        kind, text = constraint
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is None:
                try:
                    compiled = self._compile(kind, text)
                except BadRequest:
                    raise
                except Exception as error:  # xgrammar raises RuntimeError / ValueError
                    raise BadRequest(f"sampling_params.{kind} cannot be compiled: "
                                     f"{error}") from None
                self._compiled[constraint] = compiled
        return GrammarState(xgrammar.GrammarMatcher(compiled), self.vocab_size)

    def attach(self, requests) -> None:
        """Give each constrained request (`params.constraint`) its grammar state."""
        for request in requests:
            constraint = request.params.constraint
            if constraint is not None:
                request.grammar = self.state(constraint)


def mask_logits(logits: torch.Tensor, rows: list[tuple[int, GrammarState]]) -> None:
    """Set to -inf, in place, the logits (B, V) of tokens that the grammar of each
    constrained row (its index in the batch and its state) does not allow next."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], rows[0][1].vocab_size)
    for index, state in rows:
        state.fill(bitmask, index)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=rows[0][1].vocab_size,
                                         indices=[index for index, _ in rows])
