"""Per-task images, and the deterministic base commit of tasks that ship their source; the
two kinds of source and what each gives: docs/sandboxes.md#task-images.
"""

import hashlib
import io
import json
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import docker
import docker.errors

from undertow.sandboxes.base_image import AGENT_UID, BaseImageRecipe, build_base_image
from undertow.sandboxes.connection import Connection
from undertow.sandboxes.errors import ImageError
from undertow.sandboxes.task import Task

BASE_COMMIT_LABEL = "undertow.base_commit"
PRE_INSTALL_LABEL = "undertow.pre_install"
_STEP_MARKER = ">>>>> pre_install"
_IGNORED = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".pytest_cache")
_FIXED_DATE = "2000-01-01T00:00:00+0000"
_FULL_HASH = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "undertow", "GIT_AUTHOR_EMAIL": "undertow@localhost",
    "GIT_AUTHOR_DATE": _FIXED_DATE, "GIT_COMMITTER_NAME": "undertow",
    "GIT_COMMITTER_EMAIL": "undertow@localhost", "GIT_COMMITTER_DATE": _FIXED_DATE,
    "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_SYSTEM": "/dev/null", "PATH": "/usr/bin:/bin",
}


def _git(args: list[str], cwd: Path, stdin: str | None = None) -> str:
    result = subprocess.run(["git", "-c", "core.autocrlf=false", "-c", "core.fileMode=true", *args],
                            cwd=cwd, input=stdin, capture_output=True, text=True, env=_GIT_ENV)
    if result.returncode != 0:
        raise ImageError(f"git {args[0]} failed in {cwd}: {result.stderr.strip()}")
    return result.stdout.strip()


def holds_base_commit(task: Task) -> bool:
    """Whether the task's `source_dir` is a git repository (its own, not one it sits in)
    that has the task's `base_commit`, a full commit hash."""
    source = task.source_dir
    if source is None or not (source / ".git").exists() or not _FULL_HASH.match(task.base_commit):
        return False
    found = subprocess.run(["git", "-c", "safe.directory=*", "cat-file", "-e",
                            f"{task.base_commit}^{{commit}}"], cwd=source, capture_output=True,
                           env=_GIT_ENV)
    return found.returncode == 0


def _fetch_base_commit(task: Task, source: Path, dest: Path) -> str:
    """The task's base commit alone, fetched from its source repository and checked out."""
    dest.mkdir(parents=True)
    _git(["init", "-q", "-b", "main"], dest)
    _git(["-c", "safe.directory=*", "fetch", "-q", "--depth", "1", "--no-tags",
          source.resolve().as_uri(), task.base_commit], dest)
    _git(["checkout", "-q", "-B", "main", task.base_commit], dest)
    (dest / ".git" / "FETCH_HEAD").unlink(missing_ok=True)
    return _git(["rev-parse", "HEAD"], dest)


def prepare_testbed(task: Task, dest: Path) -> str:
    """Writes the task's base state with its one-commit history to `dest`; returns the hash
    (docs/sandboxes.md#task-images says which of the two kinds of source gives which)."""
    if task.source_dir is None or not task.source_dir.is_dir():
        raise ImageError(f"task {task.instance_id}: no source folder at {task.source_dir}; "
                         "a task without `image` must ship its repository")
    if holds_base_commit(task):
        return _fetch_base_commit(task, task.source_dir, dest)
    shutil.copytree(task.source_dir, dest, ignore=_IGNORED)
    _git(["init", "-q", "-b", "main"], dest)
    if task.patch.strip():
        try:
            _git(["apply", "-R", "--whitespace=nowarn", "-"], dest, stdin=task.patch)
        except ImageError as error:
            raise ImageError(f"task {task.instance_id}: the gold patch does not reverse-apply "
                             f"to {task.source_dir}: {error}") from None
    _git(["add", "-A"], dest)
    _git(["commit", "-q", "--no-gpg-sign", "-m", f"{task.instance_id} base"], dest)
    return _git(["rev-parse", "HEAD"], dest)


def compute_base_commit(task: Task) -> str:
    """The base commit hash that `prepare_testbed` (and so the task's image) produces."""
    if holds_base_commit(task):
        return task.base_commit
    with tempfile.TemporaryDirectory() as scratch:
        return prepare_testbed(task, Path(scratch) / "testbed")


def task_image_tag(task: Task) -> str:
    name = re.sub(r"[^a-z0-9_.-]+", "-", task.instance_id.lower()).strip("-.") or "task"
    return f"undertow/task-{name}:{task.base_commit[:12] or 'unstamped'}"


def _pre_install_key(task: Task) -> str:
    """What the image's pre_install steps were made from (an image label)."""
    return hashlib.sha256(json.dumps(list(task.pre_install)).encode()).hexdigest()[:16]


def _pre_install_steps(task: Task) -> str:
    """Dockerfile lines: each pre_install command as root, then its changes committed."""
    if not task.pre_install:
        return ""
    lines = ["USER 0"]
    for number, command in enumerate(task.pre_install, start=1):
        # `set -euo pipefail`, as the harness's setup_repo.sh runs them.
        marked = f"set -euo pipefail\necho '{_STEP_MARKER} {number}'\n{command}"
        lines.append(f"RUN {json.dumps(['bash', '-c', marked])}")
    commit = ("git add -A && if ! git diff --cached --quiet; then git commit -q --no-gpg-sign "
              f"-m {shlex.quote(task.instance_id + ' pre_install')}; fi && "
              f"chown -R {AGENT_UID}:{AGENT_UID} .")
    identity = " ".join(f"{key}={shlex.quote(value)}" for key, value in _GIT_ENV.items()
                        if key.startswith(("GIT_AUTHOR", "GIT_COMMITTER")))
    lines.append(f"RUN {json.dumps(['bash', '-c', f'export {identity}; {commit}'])}")
    return "\n".join(lines) + "\n"


def _context(testbed: Path, task: Task, base_tag: str, base_commit: str) -> io.BytesIO:
    dockerfile = (
        f"FROM {base_tag}\n"
        f"COPY --chown={AGENT_UID}:{AGENT_UID} testbed {task.workdir}\n"
        f"WORKDIR {task.workdir}\n"
        f"{_pre_install_steps(task)}"
        f"USER {AGENT_UID}\n"
    )
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile.encode())
        archive.addfile(info, io.BytesIO(dockerfile.encode()))
        archive.add(testbed, arcname="testbed")
    buffer.seek(0)
    return buffer


def _build_failure(task: Task, error: docker.errors.BuildError) -> ImageError:
    """The build's error, naming the pre_install command that failed, if one did."""
    log = "".join(str(line.get("stream", line)) for line in error.build_log)
    step = re.findall(rf"^{re.escape(_STEP_MARKER)} (\d+)$", log, re.MULTILINE)
    if step and task.pre_install:
        command = task.pre_install[int(step[-1]) - 1]
        return ImageError(
            f"task {task.instance_id}: pre_install command {command!r} failed while its image "
            f"was built ({error}; the build runs as root, without network):\n{log[-2000:]}")
    return ImageError(f"task {task.instance_id}: image build failed: {error}\n{log[-2000:]}")


def _build_sync(client: docker.DockerClient, task: Task, base_tag: str) -> str:
    tag = task_image_tag(task)
    wanted = {BASE_COMMIT_LABEL: task.base_commit, PRE_INSTALL_LABEL: _pre_install_key(task)}
    try:
        labels = client.images.get(tag).labels or {}
        if all(labels.get(key) == value for key, value in wanted.items()):
            return tag
    except docker.errors.ImageNotFound:
        pass
    with tempfile.TemporaryDirectory() as scratch:
        testbed = Path(scratch) / "testbed"
        base_commit = prepare_testbed(task, testbed)
        if task.base_commit and base_commit != task.base_commit:
            raise ImageError(
                f"task {task.instance_id}: its source gives base commit {base_commit}, the task "
                f"says {task.base_commit}, which {task.source_dir} does not hold as a git "
                "repository; for a source in its fixed state run `undertow tasks stamp` on "
                "the task set, for a clone give a commit it has")
        context = _context(testbed, task, base_tag, base_commit)
        labels = {BASE_COMMIT_LABEL: base_commit, PRE_INSTALL_LABEL: _pre_install_key(task),
                  "undertow.task": task.instance_id,
                  "undertow.environment_setup_commit": task.environment_setup_commit}
        try:
            client.images.build(fileobj=context, custom_context=True, tag=tag, labels=labels,
                                network_mode="none", rm=True, forcerm=True)
        except docker.errors.BuildError as error:
            raise _build_failure(task, error) from None
    return tag


def _check_published(client: docker.DockerClient, task: Task, image: str) -> str:
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        raise ImageError(f"task {task.instance_id}: image {image} is not on this Docker "
                         f"daemon; `docker pull {image}` (or load it) first") from None
    return image


async def ensure_task_image(connection: Connection, task: Task,
                            recipe: BaseImageRecipe | None = None) -> str:
    """The task's image tag: its published image, or one built (once) from its source on
    the base image, which is built first when the daemon does not have it."""
    if task.image is not None:
        return await connection.call(_check_published, connection.client, task, task.image)
    base = await build_base_image(connection, recipe or BaseImageRecipe())
    return await connection.call(_build_sync, connection.client, task, base.tag)
