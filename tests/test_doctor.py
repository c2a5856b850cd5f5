"""`undertow doctor`: each missing piece in one line with the command that fixes it."""

import os
import shutil
import subprocess
import sys

import pytest

from undertow.doctor import check_model_dir, read_system_packages, run_checks


def _doctor(*args: str, path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path}
    return subprocess.run([sys.executable, "-m", "undertow.cli", "doctor", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def _path_without(tmp_path, program: str) -> str:
    """A PATH of links to every listed program that is installed, except `program`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in read_system_packages():
        found = shutil.which(name)
        if name != program and found is not None:
            (bin_dir / name).symlink_to(found)
    return str(bin_dir)


def test_a_missing_debootstrap_fails_with_the_command_that_installs_it(tmp_path):
    result = _doctor(path=_path_without(tmp_path, "debootstrap"))
    assert result.returncode == 1, result.stdout
    lines = result.stdout.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith("FAIL debootstrap"))
    assert "not on the PATH" in lines[index]
    assert "apt-get install debootstrap" in lines[index + 1]
    assert "debootstrap" in result.stderr.splitlines()[-1]


def test_every_listed_program_is_checked(tmp_path):
    result = _doctor(path=_path_without(tmp_path, "git"))
    named = {line.split()[1].rstrip(":") for line in result.stdout.splitlines()
             if line.startswith(("ok ", "FAIL"))}
    assert set(read_system_packages()) <= named
    assert any(line.startswith("FAIL git:") for line in result.stdout.splitlines())


def test_model_dir_check_names_what_is_missing(tmp_path, tiny_model_dir):
    assert check_model_dir(tiny_model_dir).ok
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(tiny_model_dir / "config.json", partial)
    check = check_model_dir(partial)
    assert not check.ok
    assert "tokenizer.json" in check.detail and "*.safetensors" in check.detail
    assert check.fix.startswith(f"undertow model init --out {partial}")


@pytest.mark.agents  # checks OpenHands by importing it in .venv-openhands (30 s)
def test_test_purpose_adds_the_test_setups_and_a_bad_purpose_is_refused():
    names = {check.name for check in run_checks("test", None, "unix:///nonexistent.sock", None)}
    assert {"claude CLI", "codex CLI", "OpenHands", "vLLM", "docker daemon"} <= names
    run_names = {check.name for check in run_checks("run", None, "unix:///nonexistent.sock",
                                                    None)}
    assert "vLLM" not in run_names
    with pytest.raises(ValueError, match="--for 'train'"):
        run_checks("train", None, None, None)


def test_an_unreachable_daemon_fails_with_the_make_target():
    [docker] = [check for check in run_checks("run", None, "unix:///nonexistent.sock", None)
                if check.name == "docker daemon"]
    assert not docker.ok and docker.required and docker.fix.startswith("make docker-daemon")


def test_too_little_disk_for_the_tests_fails_with_what_to_free(tmp_path):
    """A temporary directory on a 16 MiB filesystem (a tmpfs in a mount namespace of its
    own): `--for test` fails on it, naming the directory and the space to free."""
    small = tmp_path / "small"
    small.mkdir()
    probe = ("import pathlib, sys; from undertow.doctor import check_test_disk; "
             "print(check_test_disk(pathlib.Path(sys.argv[1])).line())")
    result = subprocess.run(
        ["unshare", "--mount", "sh", "-c", f'mount -t tmpfs -o size=16m tmpfs "$1" && '
         f'"{sys.executable}" -c "{probe}" "$1"', "sh", str(small)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    first, fix = result.stdout.splitlines()
    assert first.startswith(f"FAIL disk for tests: 0.0 GiB free under {small}")
    assert fix.strip().startswith("fix: free at least 5 GiB there, or point TMPDIR")
