"""The one chat-template environment (`gateway/trees/template_env.py`): the gateway's renderer,
the built-in engine's tokenizer and the learner's built-model template render one text,
each with `transformers`' Jinja settings, and each refuses with its own package's error; and
where a model directory keeps its templates (`read_chat_templates`), each form read as
`transformers` reads it."""

import json

import pytest

from undertow.doctor import check_model_dir
from undertow.gateway.builtin_engine import errors as builtin_errors
from undertow.gateway.builtin_engine.tokenizer import Tokenizer
from undertow.gateway.front.toolparsers.detect import parser_of_template, template_of
from undertow.gateway.render import Renderer, TemplateError
from undertow.gateway.trees.template_env import chat_template_environment, read_chat_templates
from undertow.learner.modeldir.chat_template import ChatTemplateError, render_chat

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Wie heißt du? 名前は?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "ls",
                                                       "arguments": '{"path": "."}'}}]},
    {"role": "tool", "content": "a.py"},
]
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]


class Refused(Exception):
    pass


def refuse(message: str):
    raise Refused(message)


def test_the_three_renderers_give_one_text(tiny_model_dir):
    for add_generation_prompt in (False, True):
        learner = render_chat(CONVERSATION, TOOLS, add_generation_prompt)
        gateway = Renderer(tiny_model_dir).render(CONVERSATION, TOOLS, add_generation_prompt)
        engine = Tokenizer(tiny_model_dir).render_chat(
            CONVERSATION, tools=TOOLS, add_generation_prompt=add_generation_prompt)
        assert learner == gateway == engine
        assert "名前は" in learner and "<tool_call>" in learner


def test_transformers_settings_loop_controls_tojson_and_strftime_now():
    environment = chat_template_environment(refuse)
    template = environment.from_string(
        "{% for m in messages %}{% if m == 'stop' %}{% break %}{% endif %}"
        "{{ m | tojson }}\n{% endfor %}{{ strftime_now('%Y') | length }}")
    assert template.render(messages=["ä", "stop", "never"]) == '"ä"\n4'


def test_raise_exception_raises_what_each_renderer_passes(tiny_model_dir):
    with pytest.raises(Refused, match="no system turn"):
        chat_template_environment(refuse).from_string(
            "{{ raise_exception('no system turn') }}").render()
    bad = [{"role": "user", "content": "hi"}, {"role": "moon", "content": "?"}]
    for renderer, error in ((lambda: render_chat(bad), ChatTemplateError),
                            (lambda: Renderer(tiny_model_dir).render(bad), TemplateError),
                            (lambda: Tokenizer(tiny_model_dir).render_chat(bad),
                             builtin_errors.BadRequest)):
        with pytest.raises(error, match="moon"):
            renderer()


# Where a model directory keeps its chat templates (`read_chat_templates`), each form
# checked against what `transformers` itself loads from the same directory.

DEFAULT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
TOOL_USE = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<|python_tag|>")
MESSAGES = [{"role": "user", "content": "hi"}]


def tokenizer_dir(tiny_model_dir, path, chat_template=None, files=None):
    """A model directory's tokenizer files (the tiny model's tokenizer) with
    `chat_template` as tokenizer_config.json's value (absent when None) and `files`
    (relative path -> text) written next to it."""
    import shutil

    path.mkdir()
    shutil.copy2(tiny_model_dir / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def transformers_templates(model_dir) -> dict:
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(model_dir).chat_template
    return {"default": loaded} if isinstance(loaded, str) else dict(loaded or {})


FORMS = {
    "jinja file": dict(files={"chat_template.jinja": DEFAULT}),
    "config string": dict(chat_template=DEFAULT),
    "config list": dict(chat_template=[{"name": "default", "template": DEFAULT},
                                       {"name": "tool_use", "template": TOOL_USE}]),
    "jinja files, named": dict(files={"chat_template.jinja": DEFAULT,
                                      "additional_chat_templates/tool_use.jinja": TOOL_USE}),
    "jinja file over config": dict(chat_template="{{ 'stale' }}",
                                   files={"chat_template.jinja": DEFAULT}),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_templates_are_read_where_transformers_reads_them(tiny_model_dir, tmp_path, form):
    model_dir = tokenizer_dir(tiny_model_dir, tmp_path / "model", **FORMS[form])
    templates = read_chat_templates(model_dir)
    assert dict(templates.by_name) == transformers_templates(model_dir)
    assert templates.select(with_tools=False) == DEFAULT


def test_save_pretrained_directories_of_transformers_5_are_read(tiny_model_dir, tmp_path):
    """What `save_pretrained` writes today (the template in chat_template.jinja, named ones
    in additional_chat_templates/, none in tokenizer_config.json) reads back as it was."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_dir(tiny_model_dir, tmp_path / "source", chat_template=DEFAULT))
    tokenizer.save_pretrained(tmp_path / "single")
    tokenizer.chat_template = {"default": DEFAULT, "tool_use": TOOL_USE}
    tokenizer.save_pretrained(tmp_path / "named")
    assert "chat_template" not in json.loads(
        (tmp_path / "single" / "tokenizer_config.json").read_text())
    assert dict(read_chat_templates(tmp_path / "single").by_name) == {"default": DEFAULT}
    assert dict(read_chat_templates(tmp_path / "named").by_name) == {
        "default": DEFAULT, "tool_use": TOOL_USE}


@pytest.mark.parametrize("form", ["config list", "jinja files, named"])
def test_a_call_with_tools_renders_the_tool_use_template_as_transformers_does(
        tiny_model_dir, tmp_path, form):
    from transformers import AutoTokenizer

    model_dir = tokenizer_dir(tiny_model_dir, tmp_path / "model", **FORMS[form])
    theirs = AutoTokenizer.from_pretrained(model_dir)
    for tools in (None, TOOLS):
        expected = theirs.apply_chat_template(MESSAGES, tools=tools, tokenize=False)
        assert Renderer(model_dir).render(MESSAGES, tools) == expected
        assert Tokenizer(model_dir).render_chat(MESSAGES, tools=tools,
                                                add_generation_prompt=False) == expected
    assert "[tool ls]" in Renderer(model_dir).render(MESSAGES, TOOLS)
    assert parser_of_template(template_of(model_dir)) == "llama3_json"
    assert "chat template" not in check_model_dir(model_dir).detail


def test_no_template_and_a_malformed_one_say_what_to_do(tiny_model_dir, tmp_path):
    bare = tokenizer_dir(tiny_model_dir, tmp_path / "bare")
    assert not read_chat_templates(bare)
    with pytest.raises(FileNotFoundError, match=r"chat_template\.jinja"):
        Renderer(bare)
    with pytest.raises(builtin_errors.BadRequest, match="no chat template"):
        Tokenizer(bare).render_chat(MESSAGES)
    assert "a chat template" in check_model_dir(bare).detail
    odd = tokenizer_dir(tiny_model_dir, tmp_path / "odd", chat_template={"default": DEFAULT})
    with pytest.raises(ValueError, match=r"tokenizer_config\.json.*chat_template\.jinja"):
        read_chat_templates(odd)


def test_a_learner_checkpoint_keeps_every_template(tiny_model_dir, tmp_path):
    """`write_model_dir` (checkpoints the engines load) copies the template files too."""
    from transformers import AutoModelForCausalLM

    from undertow.learner.checkpoint import write_model_dir

    base = tokenizer_dir(tiny_model_dir, tmp_path / "base", **FORMS["jinja files, named"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    out = write_model_dir(model, base, tmp_path / "step-000001")
    assert read_chat_templates(out).by_name == read_chat_templates(base).by_name
