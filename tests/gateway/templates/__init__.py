"""Test fixtures: chat templates that behave like each model family's stock template in
what token truth meets (reasoning dropped from earlier turns, tool-call and tool-result
formats, system prompt handling, generation prompt, special tokens), written for these
tests from the families' documented behaviour (each `.jinja` file says what it
reproduces), and model directories that use them.

`family_model_dir` copies the tiny model directory with a family's template. With
`add_tokens` (for tests without an engine) the family's special tokens are added to the
tokenizer and its stop tokens become the EOS IDs, as in the real model directories;
without it (for the built-in engine, whose embedding has no room for them) they stay
plain text and the tiny model's `<|im_end|>` stays the stop token.

`Family.completion(turn, call)` is what a model of the family samples after the
generation prompt: reasoning, a short answer, and a tool call (`call`) or not, in the
family's own output format, ending with its stop token.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

HERE = Path(__file__).parent
QWEN_TOKENS = ("<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class Family:
    name: str
    parser: str  # the tool parser the gateway must detect from the template
    special_tokens: tuple[str, ...]
    stop_tokens: tuple[str, ...]
    bos_token: str | None
    completion: Callable[[int, bool], str]
    added_tokens: tuple[str, ...] = ()  # single tokens that are not special (kept in text)

    @property
    def template(self) -> str:
        return (HERE / f"{self.name}.jinja").read_text(encoding="utf-8")


def _qwen3(turn: int, call: bool) -> str:
    text = f"<think>\nStep {turn}: look closer.\n</think>\n\n"
    if call:
        return (text + f'Running it.\n<tool_call>\n{{"name": "bash", "arguments": '
                f'{{"cmd": "ls {turn}"}}}}\n</tool_call><|im_end|>')
    return text + f"Done with step {turn}.<|im_end|>"


def _qwen3_coder(turn: int, call: bool) -> str:
    if call:
        return (f"Running it.\n<tool_call>\n<function=bash>\n<parameter=cmd>\nls {turn}\n"
                "</parameter>\n</function>\n</tool_call><|im_end|>")
    return f"Done with step {turn}.<|im_end|>"


def _qwen25(turn: int, call: bool) -> str:
    if call:
        return (f'Running it.\n<tool_call>\n{{"name": "bash", "arguments": {{"cmd": "ls {turn}"'
                "}}\n</tool_call><|im_end|>")
    return f"Done with step {turn}.<|im_end|>"


def _llama3(turn: int, call: bool) -> str:
    if call:
        return f'{{"name": "bash", "parameters": {{"cmd": "ls {turn}"}}}}<|eot_id|>'
    return f"Done with step {turn}.<|eot_id|>"


def _deepseek(turn: int, call: bool) -> str:
    text = f"Step {turn}: look closer.\n</think>\n\n"  # the prompt opened the think block
    if call:
        return (text + "Running it.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
                f'<｜tool▁sep｜>bash\n```json\n{{"cmd": "ls {turn}"}}\n```'
                "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>")
    return text + f"Done with step {turn}.<｜end▁of▁sentence｜>"


def _glm45(turn: int, call: bool) -> str:
    text = f"\n<think>Step {turn}: look closer.</think>\n"
    if call:
        return (text + f"Running it.\n<tool_call>bash\n<arg_key>cmd</arg_key>\n<arg_value>ls "
                f"{turn}</arg_value>\n</tool_call><|observation|>")
    return text + f"Done with step {turn}.<|user|>"


def _harmony(turn: int, call: bool) -> str:
    text = f"<|channel|>analysis<|message|>Step {turn}: look closer.<|end|><|start|>assistant"
    if call:
        return (text + "<|channel|>commentary to=functions.bash <|constrain|>json<|message|>"
                f'{{"cmd": "ls {turn}"}}<|call|>')
    return text + f"<|channel|>final<|message|>Done with step {turn}.<|return|>"


FAMILIES = {family.name: family for family in (
    Family("qwen3", "hermes", QWEN_TOKENS, ("<|im_end|>",), None, _qwen3),
    Family("qwen3_coder", "qwen3_coder", QWEN_TOKENS, ("<|im_end|>",), None, _qwen3_coder),
    Family("qwen25", "hermes", QWEN_TOKENS, ("<|im_end|>",), None, _qwen25),
    Family("llama3", "llama3_json",
           ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|eom_id|>", "<|python_tag|>"), ("<|eot_id|>", "<|eom_id|>"),
           "<|begin_of_text|>", _llama3),
    Family("deepseek", "deepseek_v3",
           ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
           ("<｜end▁of▁sentence｜>",), "<｜begin▁of▁sentence｜>", _deepseek,
           ("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>")),
    Family("glm45", "glm45",
           ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
            "<|endoftext|>"), ("<|user|>", "<|observation|>", "<|endoftext|>"), None, _glm45),
    Family("harmony", "harmony",
           ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
            "<|return|>", "<|call|>"), ("<|return|>", "<|call|>"), None, _harmony),
)}


def family_model_dir(tiny_model_dir: Path, family: Family, out: Path,
                     add_tokens: bool = True) -> Path:
    """A copy of the tiny model directory with the family's template (see the module)."""
    shutil.copytree(tiny_model_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = family.template
    config["bos_token"] = family.bos_token
    if add_tokens:
        tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
        tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                      for token in family.special_tokens])
        tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                              for token in family.added_tokens])
        tokenizer.save(str(out / "tokenizer.json"))
        config["eos_token"] = family.stop_tokens[0]
        generation = {"eos_token_id": [tokenizer.token_to_id(t) for t in family.stop_tokens]}
        (out / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return out
