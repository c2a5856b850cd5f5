"""The run configuration (`undertow/config.py`): YAML plus dotted overrides, each section a
frozen dataclass, nested dataclasses built from nested mappings, bad keys and values named."""

import pytest

from undertow.config import build_section, read_config
from undertow.run.sections import RolloutSection
from undertow.sandboxes.sandbox import SandboxConfig


def test_a_nested_section_is_built_from_yaml_and_dotted_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  concurrency: 4\n  sandbox:\n    memory_bytes: 1073741824\n")
    tree = read_config(path, ["rollout.sandbox.git_history=keep",
                              "rollout.sandbox.num_cpus=2"])
    section = build_section(RolloutSection, tree["rollout"], "rollout")
    assert section.concurrency == 4
    assert section.sandbox == SandboxConfig(memory_bytes=2**30, git_history="keep",
                                            num_cpus=2.0)
    assert isinstance(section.sandbox.num_cpus, float)   # coerced as at the top level


def test_an_absent_nested_section_keeps_its_defaults():
    assert build_section(RolloutSection, {}, "rollout").sandbox == SandboxConfig()


@pytest.mark.parametrize(("sandbox", "message"), [
    ({"memory": 1}, r"\[rollout.sandbox\] unknown keys \['memory'\]"),
    ({"num_cpus": "two"}, r"rollout.sandbox.num_cpus: expected float, got 'two'"),
    ("keep", r"rollout.sandbox: expected a mapping of SandboxConfig's fields, got 'keep'"),
    ({"git_history": "hide"}, r"git_history must be 'squash' or 'keep'"),
])
def test_a_bad_nested_key_or_value_is_named(sandbox, message):
    with pytest.raises(ValueError, match=message):
        build_section(RolloutSection, {"sandbox": sandbox}, "rollout")


def test_an_override_into_a_value_that_is_not_a_section_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  sandbox: 3\n")
    with pytest.raises(ValueError, match="'sandbox' is not a section"):
        read_config(path, ["rollout.sandbox.network=bridge"])
    with pytest.raises(ValueError, match=r"not of the form section\.key=value"):
        read_config(None, ["rollout.sandbox"])


def test_a_float_written_without_a_dot_is_the_number_meant():
    # YAML 1.1 reads `3e-3` as a string; `sft.lr=3e-3` on the command line means 0.003.
    tree = read_config(None, ["rollout.timeout_s=3e-3", "rollout.sandbox.num_cpus=1e0"])
    section = build_section(RolloutSection, tree["rollout"], "rollout")
    assert (section.timeout_s, section.sandbox.num_cpus) == (0.003, 1.0)
