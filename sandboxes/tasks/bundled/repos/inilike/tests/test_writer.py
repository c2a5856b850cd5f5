import inilike
from inilike.writer import format_value, quote


def test_quote_escapes():
    assert quote('a"b\\c\n') == '"a\\"b\\\\c\\n"'
    assert quote("\x01") == '"\\u0001"'


def test_format_value_numbers_and_lists():
    assert format_value(3) == "3"
    assert format_value(2.5) == "2.5"
    assert format_value(["a", 1]) == '["a", 1]'


def test_dumps_simple_document():
    config = inilike.loads("name = demo\n[server]\nport = 8080\n")
    assert inilike.dumps(config) == 'name = "demo"\n\n[server]\nport = 8080\n'


def test_round_trip_keeps_strings_that_look_like_numbers():
    config = inilike.loads("[a]\nx = '12'\ny = 'true'\n")
    again = inilike.loads(inilike.dumps(config))
    assert again.get("a.x") == "12"
    assert again.get("a.y") == "true"


def test_round_trip_keeps_references_raw():
    config = inilike.loads("[a]\nx = 1\ny = '${x}'\n")
    text = inilike.dumps(config)
    assert "${x}" in text
    assert inilike.loads(text).get("a.y") == "1"


def test_dumps_empty_config():
    assert inilike.dumps(inilike.Config()) == ""
