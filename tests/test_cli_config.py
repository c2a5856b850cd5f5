"""`undertow engine serve`, `gateway serve` and `rollout` build their own frozen config
dataclasses from `-c FILE` plus `KEY=VALUE` overrides (`undertow/config.py`), refuse an
unknown key by its dotted name, list the keys in `--help`, and parse the commands of
docs/commands.md."""

import re
from pathlib import Path

import pytest
import yaml

from undertow.cli import build_parser, main
from undertow.commands.engine import engine_config
from undertow.commands.gateway import gateway_config
from undertow.commands.rollout import rollout_command
from undertow.gateway.builtin_engine.server import EngineConfig
from undertow.gateway.engine_pool.router import RouterConfig
from undertow.gateway.front.config import AutoSessionsConfig, GatewayConfig
from undertow.run.rollout import RolloutCommand

REPO = Path(__file__).resolve().parents[1]
COMMANDS_DOC = REPO / "docs" / "commands.md"
BUILDERS = {"engine": engine_config, "gateway": gateway_config, "rollout": rollout_command}
BASE = {"engine": ["engine", "serve", "--model", "m"],
        "gateway": ["gateway", "serve", "--model", "m", "--store", "s"],
        "rollout": ["rollout", "--tasks", "t", "--scaffold", "command"]}


def build(argv: list[str]):
    """The config the command line `argv` would run with."""
    args = build_parser().parse_args(argv)
    return BUILDERS[argv[0]](args)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_gateway_serve_builds_its_nested_config_from_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "store_sync: fsync\nrouter:\n  retry_after_s: 2\n"
                 "  max_in_flight_per_engine: 8\n")
    config = build([*BASE["gateway"], "--engine", "http://e:1", "--port", "7000", "-c", path,
                    "router.max_in_flight_per_engine=4", "auto_sessions.group=desk"])
    assert config == GatewayConfig(
        model_dir=Path("m"), store_dir=Path("s"), engine_urls=("http://e:1",), port=7000,
        store_sync="fsync", router=RouterConfig(retry_after_s=2.0, max_in_flight_per_engine=4),
        auto_sessions=AutoSessionsConfig(group="desk"))
    assert isinstance(config.router.retry_after_s, float)


def test_engine_serve_builds_its_config_from_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "chunked_prefill_size: 0\nnum_threads: 2\n")
    config = build([*BASE["engine"], "--host", "0.0.0.0", "-c", path, "weight_version=3",
                    "num_threads=1", "dtype=float32"])
    assert config == EngineConfig(model_dir=Path("m"), host="0.0.0.0", chunked_prefill_size=0,
                                  num_threads=1, weight_version="3", dtype="float32")


def test_rollout_builds_its_config_from_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "group_size: 4\nscaffold_options:\n  step_limit: 3\n")
    config = build([*BASE["rollout"], "--out", "o", "-c", path, "concurrency=2",
                    "scaffold_options.temperature=0", "instance_ids=[a, b]"])
    assert config == RolloutCommand(
        tasks=Path("t"), scaffold="command", out_dir=Path("o"), group_size=4, concurrency=2,
        scaffold_options={"step_limit": 3, "temperature": 0}, instance_ids=("a", "b"),
        docker_url=config.docker_url, admin_token=config.admin_token)


@pytest.mark.parametrize(("command", "override", "message"), [
    ("engine", "max_runing_requests=2", r"\[engine\] unknown keys \['max_runing_requests'\]"),
    ("gateway", "router.retry_after=2", r"\[gateway.router\] unknown keys \['retry_after'\]"),
    ("rollout", "groupsize=2", r"\[rollout\] unknown keys \['groupsize'\]"),
    ("gateway", "router.retry_after_s=soon", r"gateway.router.retry_after_s: expected float"),
    ("engine", "device=tpu", r"device='tpu' must be one of"),
    ("gateway", "model_dir=x", r"'model_dir=x': that key is set by the command's flags"),
])
def test_an_unknown_key_or_bad_value_is_refused_by_its_dotted_name(command, override, message):
    with pytest.raises(ValueError, match=message):
        build([*BASE[command], override])


def test_a_flag_owned_key_in_the_file_is_refused(tmp_path):
    path = write(tmp_path, "tasks: elsewhere\n")
    with pytest.raises(ValueError, match=r"\['tasks'\] are set by the command's flags"):
        build([*BASE["rollout"], "-c", path])


def test_the_old_flags_still_set_their_keys_and_overrides_win(tmp_path):
    gateway = build([*BASE["gateway"], "--store-sync", "fsync", "--retry-after", "3",
                     "router.retry_after_s=5"])
    assert (gateway.store_sync, gateway.router.retry_after_s) == ("fsync", 5.0)
    engine = build([*BASE["engine"], "--num-threads", "1", "--weight-version", "v0"])
    assert (engine.num_threads, engine.weight_version) == (1, "v0")
    rollout = build([*BASE["rollout"], "--group-size", "2", "--task", "a", "-o",
                     "command=echo 'a: b'", "-o", "step_limit=3"])
    assert (rollout.group_size, rollout.instance_ids) == (2, ("a",))
    assert rollout.scaffold_options == {"command": "echo 'a: b'", "step_limit": 3}


@pytest.mark.parametrize(("argv", "cls", "key", "nested"), [
    (["gateway", "serve", "--help"], GatewayConfig, "router.retry_after_s", RouterConfig()),
    (["engine", "serve", "--help"], EngineConfig, "chunked_prefill_size", None),
    (["rollout", "--help"], RolloutCommand, "timeout_value", None),
])
def test_help_lists_the_keys_with_the_dataclass_defaults(argv, cls, key, nested, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    out = capsys.readouterr().out
    leaf = key.rpartition(".")[2]
    default = getattr(nested, leaf) if nested is not None else cls.__dataclass_fields__[
        leaf].default
    assert f"  {key} = {default!r}\n" in out
    assert "  model_dir = " not in out and "  tasks = " not in out   # flags, not keys


def documented_commands() -> list[str]:
    """docs/commands.md's `undertow engine serve|gateway serve|rollout` lines, comments cut."""
    pattern = re.compile(r"^(undertow (?:engine serve|gateway serve|rollout) .*?)(?:\s+#.*)?$")
    return [match.group(1) for line in COMMANDS_DOC.read_text().splitlines()
            if (match := pattern.match(line))]


def test_the_documented_commands_still_parse_and_build():
    commands = documented_commands()
    assert {command.split()[1] for command in commands} == {"engine", "gateway", "rollout"}
    for command in commands:
        argv = command.split()[1:]
        config = build(argv)
        for override in (word for word in argv if "=" in word and not word.startswith("-")):
            key, _, value = override.partition("=")
            built = config
            for part in key.split("."):
                built = getattr(built, part)
            assert built == yaml.safe_load(value), command


def test_the_builtin_launchers_command_line_builds_the_engine_config_it_means(tmp_path):
    """`BuiltinLauncher` (used by `undertow/cells/pool.py`, `pool_backends.py` and the
    benchmarks) passes `EngineConfig` keys as `KEY=VALUE`, never a hidden alias flag, and
    each value arrives as given: a weight version that YAML would read as a number stays
    text."""
    from undertow.commands.engine import ALIASES
    from undertow.gateway.engines.launch import BuiltinLauncher

    launcher = BuiltinLauncher(weight_version="007", overrides={
        "num_threads": 2, "cache_bytes": 2**20, "device": "cpu", "dtype": "float32",
        "incremental_streaming_output": True, "served_model_name": "null"})
    argv = launcher.command(tmp_path, None)
    assert not set(argv) & set(ALIASES), argv
    config = build(argv[argv.index("engine"):])
    assert config == EngineConfig(
        model_dir=tmp_path, host="127.0.0.1", port=0, weight_version="007", num_threads=2,
        cache_bytes=2**20, device="cpu", dtype="float32", incremental_streaming_output=True,
        served_model_name="null")


def test_a_shell_command_as_a_scaffold_option_override_is_text(tmp_path):
    """What the hidden `-o command=...` did, in the documented style: the command line
    quoted as a YAML (JSON) string under `scaffold_options.command`."""
    import json

    command = "if [ -f {instance_id}.diff ]; then echo 'a: b' # x; fi"
    old = build([*BASE["rollout"], "-o", f"command={command}"])
    new = build([*BASE["rollout"], f"scaffold_options.command={json.dumps(command)}"])
    assert new.scaffold_options == old.scaffold_options == {"command": command}


def _alias_tables() -> dict[tuple[str, ...], set[str]]:
    """Each command's words, and its hidden alias flags (`-o` too, for rollout)."""
    from undertow.commands import engine, gateway, rollout

    return {("engine", "serve"): set(engine.ALIASES),
            ("gateway", "serve"): set(gateway.ALIASES),
            ("rollout",): {*rollout.ALIASES, "-o", "--option"}}


def _string_runs(node) -> list[list[str]]:
    """The string constants of each list or tuple literal, and of each call's positional
    arguments (`create_subprocess_exec(python, "-m", ...)`), under `node`, in order."""
    import ast

    items = [literal.elts if isinstance(literal, ast.List | ast.Tuple) else literal.args
             for literal in ast.walk(node) if isinstance(literal, ast.List | ast.Tuple | ast.Call)]
    return [[item.value for item in elts
             if isinstance(item, ast.Constant) and isinstance(item.value, str)]
            for elts in items]


def _contains(words: list[str], command: tuple[str, ...]) -> bool:
    return any(tuple(words[i:i + len(command)]) == command for i in range(len(words)))


def test_undertows_own_code_launches_its_commands_in_the_documented_style():
    """The hidden alias flags are for users' old scripts: no command line that Undertow's
    code, tests or benchmarks build for `engine serve`, `gateway serve` or `rollout` uses
    one, and neither does a `BuiltinLauncher`'s `extra_args`."""
    import ast

    repo = REPO
    tables = _alias_tables()
    found = []
    for folder in ("gateway", "adapters", "learner", "sandboxes", "undertow", "benchmarks",
                   "tests"):
        for path in (repo / folder).rglob("*.py"):
            if path.name == "test_cli_config.py" or path.parent.name == "commands":
                continue   # the alias tables themselves, and the test of the aliases
            tree = ast.parse(path.read_text())
            for words in _string_runs(tree):
                for command, aliases in tables.items():
                    if _contains(words, command) and set(words) & aliases:
                        found.append((path.relative_to(repo), sorted(set(words) & aliases)))
            for call in ast.walk(tree):
                if isinstance(call, ast.Call) and getattr(call.func, "id", "") == \
                        "BuiltinLauncher":
                    flags = {word for run in _string_runs(call) for word in run}
                    if flags & tables[("engine", "serve")]:
                        found.append((path.relative_to(repo), sorted(flags)))
    for line in documented_commands():   # and the docs show the documented style only
        words = line.split()
        found += [("docs/commands.md", line) for command, aliases in tables.items()
                  if _contains(words, command) and set(words) & aliases]
    assert not found, found
