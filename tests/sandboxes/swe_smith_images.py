"""Repositories and images in SWE-smith's shape, made here (offline) for tests.

SWE-smith ships one image per repository, its working tree at `main` (the fixed code),
and each instance's bug as the one commit ("Bug Patch") of a branch named after the
instance; a row's `patch` is the diff that makes the bug (`harness/gather.py`).
"""

import io
import subprocess
import tarfile
from pathlib import Path

from undertow.sandboxes.base_image import AGENT_UID

GIT = ["git", "-c", "user.name=swesmith", "-c", "user.email=swesmith@localhost",
       "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false"]


def git(repo: Path, *args: str, stdin: str | None = None) -> str:
    return subprocess.run([*GIT, *args], cwd=repo, input=stdin, check=True,
                          capture_output=True, text=True).stdout


def add_instance_branch(repo: Path, instance_id: str, make_bug) -> str:
    """Commits the bug that `make_bug(repo)` writes on branch `instance_id`, back at `main`
    after; returns the bug patch (the row's `patch`)."""
    git(repo, "checkout", "-qb", instance_id)
    make_bug(repo)
    git(repo, "add", "-A")
    bug_patch = git(repo, "diff", "--cached")
    git(repo, "commit", "-qm", "Bug Patch")
    git(repo, "checkout", "-q", "main")
    return bug_patch


def init_main(repo: Path) -> None:
    """Makes the files in `repo` the first commit of `main`."""
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "Initial commit")


def build_repository_image(client, base_image: str, repo: Path, tag: str) -> None:
    """An image of `repo` (history and branches included) at /testbed, on the base image,
    owned by and running as the non-root user, built without network."""
    dockerfile = (f"FROM {base_image}\nCOPY --chown={AGENT_UID}:{AGENT_UID} testbed /testbed\n"
                  f"WORKDIR /testbed\nUSER {AGENT_UID}\n").encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        archive.addfile(info, io.BytesIO(dockerfile))
        archive.add(repo, arcname="testbed")
    buffer.seek(0)
    client.images.build(fileobj=buffer, custom_context=True, tag=tag, network_mode="none",
                        rm=True, forcerm=True)
