import pytest

import inilike
from inilike import ParseError

DOCUMENT = """
name = demo

[server]
host = "0.0.0.0"
port = 8080
debug = false

[server.tls]
cert = '/etc/ssl/demo.pem'
ciphers = [
    "A",
    "B"
]
"""


def test_loads_nested_sections():
    config = inilike.loads(DOCUMENT)
    assert config.get("name") == "demo"
    assert config.get("server.port") == 8080
    assert config.get("server.debug") is False
    assert config.get("server.tls.ciphers") == ["A", "B"]
    assert config.sections() == ["server", "server.tls"]


def test_reopened_section_merges_keys():
    config = inilike.loads("[a]\nx = 1\n[b]\ny = 2\n[a]\nz = 3\n")
    assert config.to_dict() == {"a": {"x": 1, "z": 3}, "b": {"y": 2}}


def test_duplicate_key_is_an_error():
    with pytest.raises(ParseError, match="line 3"):
        inilike.loads("[a]\nx = 1\nx = 2\n")


def test_key_cannot_become_a_section():
    with pytest.raises(ParseError, match="cannot also be a section"):
        inilike.loads("a = 1\n[a.b]\nc = 2\n")


def test_error_column_points_into_the_value():
    with pytest.raises(ParseError) as info:
        inilike.loads('[s]\nkey = "open')
    assert (info.value.line_no, info.value.column) == (2, 7)


def test_load_reads_a_file(tmp_path):
    path = tmp_path / "app.ini"
    path.write_text("[app]\nworkers = 4\n", encoding="utf-8")
    assert inilike.load(path).get_int("app.workers") == 4
