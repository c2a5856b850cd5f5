"""`undertow model check DIR`, run as a command on model directories with each family's
kind of template (`tests/gateway/templates/`), and on one whose template ends the last
assistant turn differently from the same turn with messages after it, so that the new
messages cannot be told apart from the history: there token truth does not hold."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.gateway.templates import FAMILIES, family_model_dir

pytestmark = pytest.mark.slow


def model_check(model_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "undertow.cli", "model", "check",
                           str(model_dir), "--turns", "9"], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.parametrize("name", sorted(name for name, family in FAMILIES.items()
                                         if family.parser))  # it checks the parser too
def test_model_check_reports_token_truth_parser_and_stop_ids(tiny_model_dir, tmp_path, name):
    family = FAMILIES[name]
    checked = model_check(family_model_dir(tiny_model_dir, family, tmp_path / name))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"tool-call parser: {family.parser} " in checked.stdout
    for stop in family.stop_tokens:
        assert repr(stop) in checked.stdout
    assert checked.stdout.count(": holds (8 of 8 later calls extend") == 2
    assert "verdict: token truth holds" in checked.stdout


def test_model_check_says_what_to_set_when_token_truth_fails(tiny_model_dir, tmp_path):
    model_dir = family_model_dir(tiny_model_dir, FAMILIES["qwen25"], tmp_path / "odd")
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # the last assistant turn gets an extra marker that a followed turn does not get
    config["chat_template"] = config["chat_template"].replace(
        "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\"",
        "{%- if loop.last -%}{{- ' (last)' -}}{%- endif -%}{{- '<|im_end|>\\n' }}\n"
        "    {%- elif message.role == \"tool\"")
    assert "(last)" in config["chat_template"]
    config_path.write_text(json.dumps(config))
    checked = model_check(model_dir)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "token truth, history verbatim: FAILS" in checked.stdout
    assert "set: token_truth: template" in checked.stdout
    assert "verdict: token truth does NOT hold" in checked.stdout


@pytest.mark.parametrize("name", ["smollm2_dir", "qwen_coder_dir"])
def test_model_check_passes_on_the_pretrained_models(request, name):
    """The real directories (template in chat_template.jinja, real tokenizers): token truth
    holds in both sessions, Hermes for Qwen2.5's `<tool_call>` template, `<|im_end|>` as
    the stop token; SmolLM2's template writes no tool calls, and the check says so rather
    than asking for another parser."""
    checked = model_check(request.getfixturevalue(name))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "tool-call parser: hermes " in checked.stdout
    assert "'<|im_end|>'" in checked.stdout
    assert checked.stdout.count(": holds (8 of 8 later calls extend") == 2
    writes_none = "tool calls: the template writes none" in checked.stdout
    assert writes_none == (name == "smollm2_dir")
    assert "set: tool_parser=NAME" not in checked.stdout


def test_model_check_names_tokenizer_ids_the_embedding_lacks(tiny_model_dir, tmp_path):
    """A tokenizer of 8192 IDs on an embedding of 8000 rows: the report shows both and says
    what the gateway refuses (SGLang would exit on such an ID); token truth is unaffected."""
    model_dir = tmp_path / "small-embedding"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": 8000}))
    checked = model_check(model_dir)
    assert ("vocabulary: the tokenizer's 8192 IDs, the model's embedding 8000 rows "
            "(config.json vocab_size)") in checked.stdout, checked.stdout + checked.stderr
    assert ("set: a model whose embedding holds every tokenizer ID (vocab_size >= 8192): the "
            "gateway refuses any prompt with an ID >= 8000") in checked.stdout
    assert "vocabulary: the tokenizer's 8192 IDs, the model's embedding 8192 rows" in \
        model_check(tiny_model_dir).stdout
