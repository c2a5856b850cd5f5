"""The one chat-template environment (`gateway/template_env.py`): the gateway's renderer,
the built-in engine's tokenizer and the learner's built-model template render one text,
each with `transformers`' Jinja settings, and each refuses with its own package's error."""

import pytest

from undertow.gateway.engines.builtin import errors as builtin_errors
from undertow.gateway.engines.builtin.tokenizer import Tokenizer
from undertow.gateway.render import Renderer, TemplateError
from undertow.gateway.template_env import chat_template_environment
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
