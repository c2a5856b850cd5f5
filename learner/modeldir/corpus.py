"""The text the tokenizer is trained on: the files the repository itself ships.

The corpus is the project's own sources and docs (and the task repositories
under `sandboxes/tasks/`, where present), found next to the installed
`undertow.*` packages, so that no text is ever downloaded. The selection is
deterministic: files are ordered by their path relative to the repository root,
and the total is capped so that training stays fast as the repository grows.
"""

import importlib.util
from dataclasses import dataclass
from pathlib import Path

PACKAGES = {"gateway": "undertow.gateway", "adapters": "undertow.adapters",
            "learner": "undertow.learner", "sandboxes": "undertow.sandboxes",
            "undertow": "undertow"}
TEXT_SUFFIXES = frozenset({".py", ".md"})
MAX_FILE_BYTES = 512 * 1024
MAX_CORPUS_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class CorpusFile:
    """One file of the corpus; `name` is its path under the repository root, in posix form."""

    name: str
    path: Path


def package_folders() -> dict[str, Path]:
    """The folder of each top-level package, keyed by its name in the repository."""
    folders = {}
    for folder, package in PACKAGES.items():
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {package} has no folder; reinstall undertow "
                                    "(`pip install -e .`)")
        folders[folder] = Path(next(iter(spec.submodule_search_locations)))
    return folders


def _is_skipped(relative: Path) -> bool:
    return any(part.startswith(".") or part == "__pycache__" or part.endswith(".egg-info")
               for part in relative.parts)


def list_corpus(folders: dict[str, Path] | None = None) -> list[CorpusFile]:
    """The corpus files, sorted by name, within the per-file and total byte caps."""
    folders = package_folders() if folders is None else folders
    found = []
    for folder, root in folders.items():
        for path in root.rglob("*"):
            relative = path.relative_to(root)
            if (path.suffix in TEXT_SUFFIXES and not _is_skipped(relative)
                    and path.is_file() and not path.is_symlink()):
                found.append(CorpusFile(name=f"{folder}/{relative.as_posix()}", path=path))
    found.sort(key=lambda corpus_file: corpus_file.name)
    selected, num_bytes = [], 0
    for corpus_file in found:
        try:
            size_bytes = corpus_file.path.stat().st_size
        except FileNotFoundError:  # removed while we listed: the tree is being edited
            continue
        if size_bytes > MAX_FILE_BYTES or num_bytes + size_bytes > MAX_CORPUS_BYTES:
            continue
        selected.append(corpus_file)
        num_bytes += size_bytes
    return selected


def read_corpus(files: list[CorpusFile]) -> list[str]:
    """The text of each file that still exists; bytes that are not UTF-8 are replaced."""
    texts = []
    for corpus_file in files:
        try:
            texts.append(corpus_file.path.read_bytes().decode("utf-8", errors="replace"))
        except FileNotFoundError:
            continue
    return texts
