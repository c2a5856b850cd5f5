"""Text in and out of the built-in engine: `tokenizer.json` through the `tokenizers` library, and
the model directory's chat template (found by `template_env.read_chat_templates`) rendered with
jinja2 the way Hugging Face renders it.

Everything here is torch-free; the server uses it on the event loop (tokenizing a prompt) and the
scheduler uses `decode` for stop strings.
"""

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as FastTokenizer

from undertow.gateway.builtin_engine.errors import BadRequest
from undertow.gateway.trees.template_env import (
    chat_template_environment,
    read_chat_templates,
    special_token_text,
)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """The model directory's tokenizer: encode, decode, chat template, end-of-sequence IDs."""

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing; the engine needs a tokenizers file")
        self.fast = FastTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.templates = read_chat_templates(model_dir)
        env = chat_template_environment(_raise_exception)
        self._compiled = {text: env.from_string(text) for text in self.templates.by_name.values()}
        self.eos_token_ids = self._eos_token_ids(model_dir)

    def _eos_token_ids(self, model_dir: Path) -> frozenset[int]:
        ids: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            path = model_dir / name
            if path.exists():
                eos = json.loads(path.read_text()).get("eos_token_id")
                ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        eos_token = special_token_text(self.config.get("eos_token"))
        if isinstance(eos_token, str) and (eos_id := self.fast.token_to_id(eos_token)) is not None:
            ids.add(eos_id)
        return frozenset(ids)

    @property
    def vocab_size(self) -> int:
        return self.fast.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.fast.encode(text, add_special_tokens=True).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.fast.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list, tools: list | None = None,
                    add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text of a chat, rendered with the model directory's template."""
        text = self.templates.select(with_tools=bool(tools))
        if text is None:
            raise BadRequest(f"the model directory has no chat template (read "
                             f"{self.templates.source}); use /v1/completions or /generate "
                             "instead")
        try:
            return self._compiled[text].render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                bos_token=special_token_text(self.config.get("bos_token")) or "",
                eos_token=special_token_text(self.config.get("eos_token")) or "", **extra)
        except jinja2.exceptions.TemplateError as error:
            raise BadRequest(f"the chat template rejected the messages: {error}") from error
