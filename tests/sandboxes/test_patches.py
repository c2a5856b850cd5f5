"""Reversing a git diff (SWE-smith's `patch` makes the bug; the task's fix is its reverse)."""

import subprocess

import pytest

from tests.sandboxes.dataset_rows import SWE_SMITH
from undertow.sandboxes.datasets.formats import convert_swe_smith
from undertow.sandboxes.datasets.patches import reverse_patch

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]


def _run(repo, *args, stdin=None) -> str:
    return subprocess.run([*GIT, *args], cwd=repo, input=stdin, check=True,
                          capture_output=True, text=True).stdout


def _write(repo, name, text, mode=None):
    (repo / name).write_text(text)
    if mode is not None:
        (repo / name).chmod(mode)


def test_the_reverse_undoes_every_kind_of_change(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _run(repo, "init", "-q")
    _write(repo, "edit.txt", "".join(f"line {i}\n" for i in range(20)))
    _write(repo, "gone.txt", "x\ny\n")
    _write(repo, "moved.py", "one\ntwo\nthree\nfour\nfive\nsix\n")
    _write(repo, "no_newline.txt", "last")
    _write(repo, "run.sh", "echo hi\n", 0o644)
    _run(repo, "add", "-A")
    _run(repo, "commit", "-qm", "before")
    before = _run(repo, "rev-parse", "HEAD^{tree}").strip()

    _write(repo, "edit.txt", "first\n" + "".join(
        f"line {i}\n" if i != 15 else "changed\n" for i in range(1, 20)) + "added\n")
    (repo / "gone.txt").unlink()
    _write(repo, "new.txt", "fresh\n")
    _run(repo, "mv", "moved.py", "renamed.py")
    _write(repo, "renamed.py", "one\ntwo\nTHREE\nfour\nfive\nsix\n")
    _write(repo, "no_newline.txt", "still last")
    (repo / "run.sh").chmod(0o755)
    _run(repo, "add", "-A")
    forward = _run(repo, "diff", "--cached")
    _run(repo, "commit", "-qm", "after")

    backward = reverse_patch(forward)
    assert backward != forward and reverse_patch(backward) == forward
    _run(repo, "apply", "--index", "-", stdin=backward)
    assert _run(repo, "write-tree").strip() == before


def test_binary_patches_cannot_be_reversed():
    with pytest.raises(ValueError, match="GIT"):
        reverse_patch("diff --git a/x.bin b/x.bin\nindex 1..2 100644\nGIT binary patch\n"
                      "literal 1\nIcmZo*000\n\n")


def test_swe_smith_rows_store_the_fix():
    row = {**SWE_SMITH[0], "patch": (
        "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-good\n+bad\n")}
    record = convert_swe_smith(row)
    assert record["patch"] == (
        "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n+good\n-bad\n")
    assert record["start_commands"] == [
        f"git show-ref -q {row['instance_id']} || git fetch -q origin {row['instance_id']}",
        f"git checkout -q {row['instance_id']}"]
    assert record["base_commit"] == row["base_commit"]
