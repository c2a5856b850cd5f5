import pytest

from calclang import LexError, tokenize


def kinds_and_values(source):
    return [(token.kind, token.value) for token in tokenize(source)]


def test_numbers_names_and_keywords():
    assert kinds_and_values("let x1 = 42 + 2.5;") == [
        ("keyword", "let"), ("name", "x1"), ("op", "="), ("number", 42), ("op", "+"),
        ("number", 2.5), ("op", ";"), ("eof", None),
    ]


def test_two_character_operators():
    texts = [token.text for token in tokenize("a <= b >= c == d ** e")]
    assert texts == ["a", "<=", "b", ">=", "c", "==", "d", "**", "e", ""]


def test_string_escapes():
    (token, _) = tokenize(r'"tab\tquote\" backslash\\"')
    assert token.value == 'tab\tquote" backslash\\'


def test_line_numbers():
    tokens = tokenize("a\nb\n\nc")
    assert [token.line for token in tokens] == [1, 2, 4, 4]


def test_comment_at_end_of_input():
    assert kinds_and_values("x # done") == [("name", "x"), ("eof", None)]


def test_errors():
    with pytest.raises(LexError, match="never closed"):
        tokenize('"abc')
    with pytest.raises(LexError, match="line 2"):
        tokenize("a\n@")
