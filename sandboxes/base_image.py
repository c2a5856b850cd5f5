"""The base image every task image derives from, built offline from Debian packages
(debootstrap, then `docker import`), once per recipe: docs/sandboxes.md#the-base-image.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import docker
import docker.errors
from docker.models.images import Image

from undertow.sandboxes.connection import Connection
from undertow.sandboxes.errors import ImageError

RECIPE_LABEL = "undertow.recipe"
AGENT_UID = 1000
DEFAULT_MIRROR = "http://deb.debian.org/debian"


@dataclass(frozen=True)
class BaseImageRecipe:
    """What goes into the base image; its hash names the image's content."""

    tag: str = "undertow/base:bookworm"
    suite: str = "bookworm"
    packages: tuple[str, ...] = (
        "python3", "python-is-python3", "python3-pytest", "git", "procps", "tini")
    user: str = "agent"
    revision: int = 1

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class BaseImage:
    """The outcome of `build_base_image`: the tag, and whether it was built or reused."""

    tag: str
    image_id: str
    reused: bool


def apt_mirror(sources_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror the host's apt uses (one-line or deb822 form), else deb.debian.org."""
    candidates = []
    one_line = sources_dir / "sources.list"
    if one_line.exists():
        for line in one_line.read_text().splitlines():
            words = line.split()
            if len(words) >= 3 and words[0] == "deb":
                url = next(word for word in words[1:] if not word.startswith("["))
                candidates.append(url)
    for sources in sorted((sources_dir / "sources.list.d").glob("*.sources")):
        for stanza in sources.read_text().split("\n\n"):
            entries = dict(line.split(":", 1) for line in stanza.splitlines() if ":" in line
                           and not line.startswith("#"))
            candidates.extend(entries.get("URIs", "").split())
    for url in candidates:
        if url.rstrip("/").endswith("/debian"):
            return url
    return DEFAULT_MIRROR


def find_base_image(client: docker.DockerClient, recipe: BaseImageRecipe) -> Image | None:
    """The image built from `recipe` (its tag, with the recipe's hash as label), or None."""
    try:
        image = client.images.get(recipe.tag)
    except docker.errors.ImageNotFound:
        return None
    return image if image.labels.get(RECIPE_LABEL) == recipe.digest() else None


def _debootstrap(recipe: BaseImageRecipe, mirror: str, root: Path) -> None:
    if shutil.which("debootstrap") is None:
        raise ImageError("debootstrap is not installed: run `apt-get install debootstrap` as root")
    if os.geteuid() != 0:
        raise ImageError("building the base image needs root (debootstrap): run it as root once")
    command = ["debootstrap", "--variant=minbase", f"--include={','.join(recipe.packages)}",
               recipe.suite, str(root), mirror]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise ImageError(f"debootstrap failed (exit {result.returncode}) using mirror {mirror}: "
                         f"{result.stdout[-2000:]}{result.stderr[-2000:]}")


def _add_user(root: Path, user: str) -> None:
    """Adds the non-root user by editing the account files (no chroot needed)."""
    with (root / "etc/passwd").open("a") as passwd:
        passwd.write(f"{user}:x:{AGENT_UID}:{AGENT_UID}::/home/{user}:/bin/bash\n")
    with (root / "etc/group").open("a") as group:
        group.write(f"{user}:x:{AGENT_UID}:\n")
    with (root / "etc/shadow").open("a") as shadow:
        shadow.write(f"{user}:!:19000:0:99999:7:::\n")
    home = root / "home" / user
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, AGENT_UID, AGENT_UID)


def _finish_root(root: Path, user: str) -> None:
    _add_user(root, user)
    # Grading runs git as root in the agent's repository; never let ownership stop it.
    (root / "etc/gitconfig").write_text("[safe]\n\tdirectory = *\n")
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for entry in (root / cache).glob("*"):
            if entry.is_file():
                entry.unlink()


def _rootfs_tarball(recipe: BaseImageRecipe, mirror: str, cache_dir: Path) -> Path:
    tarball = cache_dir / f"base-{recipe.digest()}.tar"
    if tarball.exists():
        return tarball
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        root = Path(scratch) / "root"
        _debootstrap(recipe, mirror, root)
        _finish_root(root, recipe.user)
        partial = Path(scratch) / "rootfs.tar"
        subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."],
                       check=True)
        partial.rename(tarball)
    return tarball


def _import(client: docker.DockerClient, recipe: BaseImageRecipe, tarball: Path) -> str:
    repository, tag = recipe.tag.rsplit(":", 1)
    changes = [
        f"LABEL {RECIPE_LABEL}={recipe.digest()}",
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "ENV LANG=C.UTF-8",
        f"USER {recipe.user}",
        f"WORKDIR /home/{recipe.user}",
        'CMD ["sleep", "infinity"]',
    ]
    client.api.import_image_from_file(str(tarball), repository=repository, tag=tag,
                                      changes=changes)
    image = find_base_image(client, recipe)
    if image is None:
        raise ImageError(f"docker import of {tarball} did not produce {recipe.tag}")
    return _image_id(image)


def _image_id(image: Image) -> str:
    # docker's `Model.id` is `attrs.get("Id")`, so typed Optional; an image the daemon
    # returned always has one.
    assert image.id is not None, f"the daemon returned image {image.tags} without an ID"
    return image.id


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Holds an flock on `lock_path`; it excludes other threads of this process too."""
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_sync(client: docker.DockerClient, recipe: BaseImageRecipe = BaseImageRecipe(),
                cache_dir: Path | None = None, mirror: str | None = None) -> BaseImage:
    existing = find_base_image(client, recipe)
    if existing is not None:
        return BaseImage(recipe.tag, _image_id(existing), reused=True)
    cache_dir = cache_dir or Path.home() / ".cache" / "undertow"
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_dir / f"base-{recipe.digest()}.lock"):
        existing = find_base_image(client, recipe)  # built while this one waited for the lock
        if existing is not None:
            return BaseImage(recipe.tag, _image_id(existing), reused=True)
        tarball = _rootfs_tarball(recipe, mirror or apt_mirror(), cache_dir)
        return BaseImage(recipe.tag, _import(client, recipe, tarball), reused=False)


async def build_base_image(connection: Connection, recipe: BaseImageRecipe = BaseImageRecipe(),
                           cache_dir: Path | None = None, mirror: str | None = None) -> BaseImage:
    """Builds the base image unless one from the same recipe exists (then says it reused it).

    Safe to call from many sessions and processes at once: one builds, the others wait."""
    return await connection.call(_build_sync, connection.client, recipe, cache_dir, mirror)
