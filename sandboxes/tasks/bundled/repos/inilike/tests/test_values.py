import pytest

from inilike.errors import ParseError
from inilike.values import convert_bare, parse_value


def value(text):
    return parse_value(text, 1, 5)


def test_numbers():
    assert value("42") == 42
    assert value("-7") == -7
    assert value("1_000") == 1000
    assert value("0xFF") == 255
    assert value("2.5") == 2.5
    assert value("1e-3") == 0.001


def test_booleans_and_bare_text():
    assert value("true") is True
    assert value("false") is False
    assert value("hello world") == "hello world"
    assert convert_bare("True") == "True"


def test_basic_string_escapes():
    assert value(r'"a\tb\nc"') == "a\tb\nc"
    assert value(r'"say \"hi\""') == 'say "hi"'
    assert value(r'"back\\slash"') == "back\\slash"


def test_literal_string_has_no_escapes():
    assert value(r"'C:\temp\new'") == r"C:\temp\new"


def test_arrays():
    assert value("[]") == []
    assert value('[1, "two", [3, 4], true]') == [1, "two", [3, 4], True]
    assert value("[a, b]") == ["a", "b"]


def test_multi_line_array_value():
    assert parse_value("[\n1,\n2\n]", 1, 5) == [1, 2]


def test_unknown_escape_is_an_error():
    with pytest.raises(ParseError, match="unknown escape"):
        value(r'"\q"')


def test_unclosed_string_reports_its_column():
    with pytest.raises(ParseError) as info:
        value('"abc')
    assert info.value.line_no == 1
    assert info.value.column == 5


def test_text_after_a_value_is_an_error():
    with pytest.raises(ParseError, match="after the value"):
        value('"a" b')


def test_missing_comma_in_array():
    with pytest.raises(ParseError, match="expected ','"):
        value('["a" "b"]')
