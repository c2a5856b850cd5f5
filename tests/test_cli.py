"""`undertow/cli.py`: one module of `undertow/commands/` per command group declares the
whole group, the groups are the commands docs/commands.md lists, and building the parser
(`undertow --help`) imports no command's work."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from undertow.cli import COMMAND_GROUPS

REPO = Path(__file__).resolve().parents[1]


class RecordingParser(argparse.ArgumentParser):
    """A real parser that keeps the sub-parsers object it hands out."""

    commands: "Recorder | None" = None

    def add_subparsers(self, **kwargs: Any) -> "Recorder":   # type: ignore[override]
        super().add_subparsers(**kwargs)
        self.commands = Recorder()
        return self.commands


class Recorder:
    """Stands for argparse's sub-parsers object: records each command a group adds."""

    def __init__(self) -> None:
        self.parsers: dict[str, RecordingParser] = {}

    def add_parser(self, name: str, **kwargs: Any) -> RecordingParser:
        assert name not in self.parsers, f"{name} declared twice"
        kwargs.pop("help", None)   # the sub-parsers object's, not the parser's
        self.parsers[name] = RecordingParser(prog=name, **kwargs)
        return self.parsers[name]


def leaves(commands: Recorder, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Each command that runs (no sub-commands) -> its handler."""
    found = {}
    for name, parser in commands.parsers.items():
        if parser.commands is not None:
            found.update(leaves(parser.commands, (*path, name)))
        else:
            found[(*path, name)] = parser.get_default("handler")
    return found


def documented_commands() -> set[tuple[str, ...]]:
    """The commands of docs/commands.md's block: `undertow GROUP [SUB]`, and each
    `| SUB` alternative (`undertow sandbox build-base | gc`)."""
    text = (REPO / "docs" / "commands.md").read_text()
    block = text.split("```", 2)[1]
    found = set()
    for line in block.splitlines():
        if not line.startswith("undertow "):
            continue
        command = line.split("#")[0].split()[1:]
        words = [word for word in command[:2] if re.fullmatch(r"[a-z][a-z0-9-]*", word)]
        found.add(tuple(words))
        for alternative in re.findall(r"\| ([a-z][a-z0-9-]*)", line.split("#")[0]):
            found.add((words[0], alternative))
    return found


def test_each_group_is_declared_whole_by_its_own_module():
    declared = {}
    for group in COMMAND_GROUPS:
        recorder = Recorder()
        group.add(recorder)
        for path, handler in leaves(recorder).items():
            assert handler is not None, f"`undertow {' '.join(path)}` sets no handler"
            assert handler.__module__ == group.__name__, (path, handler.__module__)
            assert path not in declared, f"`undertow {' '.join(path)}` declared twice"
            declared[path] = group.__name__
    assert set(declared) == documented_commands()
    assert declared[("trees", "repair")] == declared[("trees", "show")]
    assert declared[("model", "fetch")] == declared[("model", "init")]


# Prints the Undertow modules and the heavy outside packages `undertow --help` loaded.
HELP_PROBE = """
import json, sys
from undertow.cli import main
try:
    main(["--help"])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in
                        ("undertow", "torch", "numpy", "transformers", "aiohttp"))))
"""


def test_help_imports_no_command_work_and_no_torch():
    done = subprocess.run([sys.executable, "-c", HELP_PROBE], capture_output=True, text=True,
                          check=True)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    allowed = {"undertow", "undertow.cli", "undertow.config", "undertow.errors",
               "undertow.commands"}
    heavy = [m for m in loaded if m not in allowed and not m.startswith("undertow.commands.")]
    assert not heavy, f"`undertow --help` imports {heavy[:5]}: import them in the handler"
