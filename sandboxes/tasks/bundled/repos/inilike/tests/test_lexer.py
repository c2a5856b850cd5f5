import pytest

from inilike.errors import ParseError
from inilike.lexer import bracket_depth, logical_lines, strip_comment


def test_strip_comment_removes_hash_and_semicolon_comments():
    assert strip_comment("port = 80 # web") == "port = 80"
    assert strip_comment("port = 80 ; web") == "port = 80"
    assert strip_comment("# whole line") == ""


def test_strip_comment_keeps_hash_inside_a_word():
    assert strip_comment("color = #fff") == "color ="
    assert strip_comment("color=a#fff") == "color=a#fff"


def test_strip_comment_keeps_hash_inside_quotes():
    assert strip_comment('url = "http://x/ #top" # c') == 'url = "http://x/ #top"'
    assert strip_comment("path = '/tmp/;x' ; c") == "path = '/tmp/;x'"


def test_bracket_depth_ignores_quoted_brackets():
    assert bracket_depth('["a]", [1') == 2
    assert bracket_depth("[1, 2]") == 0


def test_logical_lines_skip_blanks_and_comments():
    lines = list(logical_lines("\n# c\n[s]\n\nk = v\n"))
    assert [(line.kind, line.name, line.line_no) for line in lines] == [
        ("section", "s", 3),
        ("pair", "k", 5),
    ]


def test_value_column_is_one_based():
    (line,) = logical_lines("  key =   value")
    assert line.value == "value"
    assert line.value_column == 11


def test_multi_line_array_is_joined():
    (line,) = logical_lines("a = [\n  1,  # one\n  2\n]\n")
    assert line.line_no == 1
    assert line.value.replace("\n", " ").split() == ["[", "1,", "2", "]"]


def test_unclosed_array_is_an_error():
    with pytest.raises(ParseError, match="never closed"):
        list(logical_lines("a = [1,\n2\n"))


def test_bad_key_name_is_an_error():
    with pytest.raises(ParseError, match="line 2"):
        list(logical_lines("[s]\nbad key = 1"))


def test_section_without_closing_bracket():
    with pytest.raises(ParseError, match="closing"):
        list(logical_lines("[server"))
