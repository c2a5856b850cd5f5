"""The command adapter's templating and environment."""

from undertow.adapters.command import CommandScaffold, render_template
from undertow.adapters.registry import SCAFFOLDS, create_scaffold


def test_known_placeholders_are_replaced_and_others_kept():
    text = render_template('agent --url {base_url} --x ${HOME} \'{"a": 1}\' {unknown}',
                           {"base_url": "http://g/s/1/v1"})
    assert text == 'agent --url http://g/s/1/v1 --x ${HOME} \'{"a": 1}\' {unknown}'


def test_environment_carries_both_apis():
    scaffold = CommandScaffold("true", env={"EXTRA": "{model}-{session_id}"})
    values = {"base_url": "http://g/s/s1/v1", "anthropic_base_url": "http://g/s/s1",
              "api_key": "k", "model": "m", "session_id": "s1"}
    env = scaffold.environment(values)
    assert env["OPENAI_BASE_URL"] == "http://g/s/s1/v1"
    assert env["ANTHROPIC_BASE_URL"] == "http://g/s/s1"
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == "k"
    assert env["EXTRA"] == "m-s1"


def test_every_registered_scaffold_builds():
    for name in SCAFFOLDS:
        options = {"command": "true"} if name == "command" else {}
        assert create_scaffold(name, options).name == name
