import pytest

import inilike
from inilike import ConfigError, InterpolationError, MissingKeyError


def test_get_with_default_and_missing():
    config = inilike.loads("[a]\nx = 1\n")
    assert config.get("a.y", None) is None
    with pytest.raises(MissingKeyError):
        config.get("a.y")
    assert "a.x" in config
    assert "a.y" not in config


def test_typed_getters():
    config = inilike.loads("[a]\nn = '12'\nf = 2\nb = yes\nl = x, y\n")
    assert config.get_int("a.n") == 12
    assert config.get_float("a.f") == 2.0
    assert config.get_bool("a.b") is True
    assert config.get_list("a.l") == ["x", "y"]


def test_get_bool_rejects_other_words():
    config = inilike.loads("[a]\nb = maybe\n")
    with pytest.raises(ConfigError):
        config.get_bool("a.b")


def test_interpolation_same_section_and_absolute():
    config = inilike.loads(
        "root = /srv\nlogs = '${root}/logs'\n[web]\nhost = h\nport = 80\nurl = 'http://${host}:${port}/'\n"
        "[paths]\nlogs = '${web.host}/logs'\n"
    )
    assert config.get("web.url") == "http://h:80/"
    assert config.get("paths.logs") == "h/logs"
    assert config.get("logs") == "/srv/logs"


def test_interpolation_chains_and_dollar_escape():
    config = inilike.loads("[a]\nx = 1\ny = '${x}0'\nz = '${y}0 $$5'\n")
    assert config.get("a.z") == "100 $5"
    assert config.get("a.z", interpolate=False) == "${y}0 $$5"


def test_interpolation_cycle_is_reported():
    config = inilike.loads("[a]\nx = '${y}'\ny = '${x}'\n")
    with pytest.raises(InterpolationError, match="cycle"):
        config.get("a.x")


def test_interpolation_of_missing_key():
    config = inilike.loads("[a]\nx = '${nope}'\n")
    with pytest.raises(InterpolationError, match="does not exist"):
        config.get("a.x")


def test_section_view_and_set():
    config = inilike.loads("[a]\nx = 1\n")
    config.set("b.c.d", True)
    assert config.get("b.c.d") is True
    assert config.section("a").get("x") == 1
    with pytest.raises(ConfigError):
        config.get("b")


def test_merge_overrides_values():
    base = inilike.loads("[a]\nx = 1\ny = 2\n")
    override = inilike.loads("[a]\ny = 3\n[b]\nz = 4\n")
    merged = base.merge(override)
    assert merged.to_dict() == {"a": {"x": 1, "y": 3}, "b": {"z": 4}}
