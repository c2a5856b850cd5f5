"""The README is a front door whose every command runs, and the docs' links resolve.

Every command in the README's fenced shell blocks (```bash, ```sh, ```shell, ```console or a
fence with no language; a line joined with its `\\` continuations, its comment cut) must be in
`COVERED`, which says how a test runs it:

- `Direct`: this test runs it as written, with the real CLI in a subprocess;
- `AgentSection`: `tests/e2e/test_use_with_agent.py` runs it verbatim (its block is one of
  that test's blocks, read from the README the same way);
- `MakeTarget`: a `make` target whose commands are checked against what CI runs (`.ci/run`),
  or run here;
- `Training`: a training run, built here by the CLI's own parser and config loader, and run
  end to end (shortened by overrides) by the named test in `tests/e2e/`.

A command added to the README without an entry here fails `test_every_readme_command_is_run`,
and an entry whose command left the README fails `test_no_entry_outlives_its_command`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
MARKDOWN_FILES = [README, REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
VENV_BIN = Path(sys.prefix) / "bin"   # this interpreter's virtualenv: a new shell lacks it
SET_UP = "## Set-up"


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """Each fenced block of a Markdown text as (its language, its body)."""
    blocks, language, body = [], None, []
    for line in text.splitlines(keepends=True):
        fence = line.strip()
        if language is None and fence.startswith("```"):
            language, body = fence[3:].strip(), []
        elif language is not None and fence == "```":
            blocks.append((language, "".join(body)))
            language = None
        elif language is not None:
            body.append(line)
    return blocks


def cut_comment(line: str) -> str:
    """The line before a `#` that starts a shell comment (outside quotes, after a blank)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def commands_of(script: str) -> list[str]:
    """A shell block's commands: continuations joined, comments cut, blanks collapsed."""
    joined = re.sub(r"\\\n", " ", script)
    commands = (" ".join(cut_comment(line).split()) for line in joined.splitlines())
    return [command for command in commands if command]


def readme_commands() -> list[str]:
    """Every command of the README's shell blocks, in order, each once."""
    found = [command for language, body in fenced_blocks(README.read_text())
             if language in SHELL_FENCES for command in commands_of(body)]
    return list(dict.fromkeys(found))


def section_commands(heading: str) -> list[str]:
    """The commands of the shell blocks of one README section (up to the next `## `)."""
    text = README.read_text()
    section = text[text.index(heading + "\n"):]
    section = re.split(r"^## ", section[len(heading):], maxsplit=1, flags=re.M)[0]
    return [command for language, body in fenced_blocks(section)
            if language in SHELL_FENCES for command in commands_of(body)]


def activation() -> str:
    """The Set-up section's command that puts `undertow` on a new shell's PATH."""
    found = [c for c in section_commands(SET_UP) if re.match(r"(\.|source) \S*activate$", c)]
    assert len(found) == 1, f"the README's {SET_UP} activates the virtualenv once: {found}"
    return found[0]


def new_shell(script: str, env: dict[str, str] | None = None,
              timeout_s: float = 300) -> subprocess.CompletedProcess:
    """`script` by bash, from the repository, as a new shell after set-up runs it: no
    virtualenv on the PATH, so `undertow` is found only as the README says."""
    path = os.pathsep.join(entry for entry in os.environ.get("PATH", "").split(os.pathsep)
                           if entry and Path(entry) != VENV_BIN)
    base = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, env={**base, "PATH": path, **(env or {})})


def run_shell(command: str, env: dict[str, str] | None = None,
              timeout_s: float = 300) -> subprocess.CompletedProcess:
    """The command as written, in a new shell that first ran the README's activation."""
    return new_shell(f"{activation()}\n{command}", env, timeout_s)


def make_dry_run(target: str, *variables: str) -> list[str]:
    """The shell lines `make -n TARGET` would run, continuations joined."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "-n", target, *variables], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=env)   # not a parent make's flags
    assert done.returncode == 0, done.stderr
    return [line for line in re.sub(r"\\\n\s*", " ", done.stdout).splitlines() if line]


def as_undertow(line: str) -> str:
    """A Makefile recipe line with the venv's `python -m undertow.cli` read as `undertow`."""
    return re.sub(r"^(\S+=\S+ )*\S*python -m undertow\.cli", "undertow", line)


def check_doctor_report(done: subprocess.CompletedProcess) -> None:
    """A doctor's report: `ok` or `FAIL` rows, a fix under each FAIL, exit 1 iff a FAIL."""
    rows = done.stdout.splitlines()
    assert any(row.startswith("ok ") for row in rows), done.stdout + done.stderr
    failed = [i for i, row in enumerate(rows) if row.startswith("FAIL ")]
    for i in failed:
        assert rows[i + 1].strip().startswith("fix: "), rows[i:i + 2]
    assert done.returncode == (1 if failed else 0), done.stdout + done.stderr


@dataclass(frozen=True)
class Direct:
    """Run here as written; `settings` names fixtures whose path a variable of it is set to."""
    settings: tuple[tuple[str, str], ...] = ()
    doctor: bool = False

    def check(self, command: str, request) -> None:
        env = {name: str(request.getfixturevalue(fixture)) for name, fixture in self.settings}
        done = run_shell(command, env)
        if self.doctor:
            check_doctor_report(done)
        else:
            assert done.returncode == 0, done.stdout + done.stderr


@dataclass(frozen=True)
class AgentSection:
    """One of the commands `tests/e2e/test_use_with_agent.py` runs verbatim, block by block."""

    def check(self, command: str, request) -> None:
        from tests.e2e import test_use_with_agent

        blocks = test_use_with_agent.readme_blocks()
        assert command in {c for block in blocks for c in commands_of(block)}, command


@dataclass(frozen=True)
class MakeTarget:
    """`make run`, `make test` or `make test-fast`, each checked in its own way."""

    def check(self, command: str, request) -> None:
        target = command.removeprefix("make ")
        {"test": self.ci_runs_it, "run": self.doctor_then_train,
         "test-fast": self.runs_a_test_in_parallel}[target]()

    @staticmethod
    def ci_runs_it() -> None:
        """CI's entry point runs exactly `make test`, whose last step is the suite."""
        ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
        assert ci[-1] == "make test", ci
        assert re.search(r"-m pytest -m \"not qwen\"", make_dry_run("test")[-1])

    @staticmethod
    def doctor_then_train() -> None:
        """Its recipe is `undertow doctor --for run`, run here, then `undertow train`, which
        is the README's default run (its own entry)."""
        lines = make_dry_run("run")
        recipe = [as_undertow(line) for line in lines if "-m undertow.cli" in line]
        assert recipe == ["undertow doctor --for run", "undertow train"], recipe
        assert activation() in lines[-1], lines[-1]   # it ends by saying how to reach the CLI
        assert "undertow train" in readme_commands()
        check_doctor_report(run_shell("undertow doctor --for run"))

    @staticmethod
    def runs_a_test_in_parallel() -> None:
        """The pytest line it runs, with one cheap test of this module as its argument, run
        for real: the marker selection parses and the workers (pytest-xdist) start."""
        one = f"{Path(__file__).relative_to(REPO)}::test_commands_are_cut_from_shell_blocks_only"
        line = make_dry_run("test-fast", f"PYTEST_ARGS={one} -p no:randomly")[-1]
        selection = re.search(r'-m "([^"]+)"', line).group(1)
        assert {"not docker", "not vllm", "not slow"} <= set(selection.split(" and ")), line
        assert re.search(r" -n \d", line), line
        done = run_shell(line)
        assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


@dataclass(frozen=True)
class Training:
    """Built by `undertow train`'s own parser and loader here; run end to end, shortened by
    overrides, by `test_file`, which names its config."""
    test_file: str
    config_name: str

    def check(self, command: str, request) -> None:
        from undertow.cli import build_parser
        from undertow.run.sections import load_sections

        request.getfixturevalue("monkeypatch").chdir(REPO)   # its paths are the README's
        args = build_parser().parse_args(shlex.split(command)[1:])
        sections = load_sections(args.config, args.overrides, args.run_dir, args.resume)
        assert sections.learner.num_steps > 0
        named = args.config.name if args.config else "learn.yaml"
        assert named == self.config_name, (named, self.config_name)
        assert self.config_name in (REPO / self.test_file).read_text(), self.test_file


COVERED = {
    "make run": MakeTarget(),
    "make test": MakeTarget(),
    "make test-fast": MakeTarget(),
    ". .venv/bin/activate": Direct(),
    "undertow doctor": Direct(doctor=True),
    "undertow model check $MODEL": Direct(settings=(("MODEL", "tiny_model_dir"),)),
    "undertow train": Training("tests/e2e/test_learning.py", "learn.yaml"),
    "undertow train -c undertow/configs/swe.yaml": Training("tests/e2e/test_train.py", "swe.yaml"),
    "undertow train -c undertow/configs/learn-smollm2.yaml":
        Training("tests/e2e/test_train_pretrained.py", "learn-smollm2.yaml"),
}


def agent_section_commands() -> set[str]:
    from tests.e2e import test_use_with_agent

    return {c for block in test_use_with_agent.readme_blocks() for c in commands_of(block)}


def coverage_of(command: str):
    if command in COVERED:
        return COVERED[command]
    return AgentSection() if command in agent_section_commands() else None


@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_command_is_run(command, request):
    covered = coverage_of(command)
    assert covered is not None, (
        f"README command {command!r} is run by no test: run it in a test and name that "
        "test in tests/test_readme.py's COVERED")
    covered.check(command, request)


def test_no_entry_outlives_its_command():
    assert set(COVERED) <= set(readme_commands()), set(COVERED) - set(readme_commands())


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    assert len(readme_commands()) <= 30, readme_commands()


def test_a_new_shell_after_set_up_runs_the_first_commands():
    """The Set-up section's commands after `make`, as written, in one new shell: `undertow`
    is found; without the activation it is not (so the shell really is a new one)."""
    first = [c for c in section_commands(SET_UP) if not c.startswith("make ")]
    assert first and first[0] == activation() and "undertow doctor" in first, first
    check_doctor_report(new_shell("\n".join(first)))
    bare = new_shell("\n".join(first[1:]))
    assert bare.returncode == 127 and "undertow: command not found" in bare.stderr, bare


def test_commands_are_cut_from_shell_blocks_only():
    text = ("```bash\nmake a   # why\nundertow b \\\n  --c 'd # e'\n\n# a comment\n```\n"
            "```yaml\nrun: {x: 1}\n```\n```text\nnot a command\n```\n```\nmake f\n```\n")
    found = [c for language, body in fenced_blocks(text) if language in SHELL_FENCES
             for c in commands_of(body)]
    assert found == ["make a", "undertow b --c 'd # e'", "make f"]


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    prose = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {github_anchor(line.lstrip("#")) for line in prose.splitlines()
            if re.match(r"#{1,6} ", line)}


def relative_links(path: Path) -> list[str]:
    """The targets of `[text](target)` and `![alt](target)` outside code, but web links."""
    prose = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", prose)
            if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    broken = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists() or (anchor and resolved.suffix == ".md"
                                     and anchor not in anchors_of(resolved)):
            broken.append(target)
    assert not broken, broken
