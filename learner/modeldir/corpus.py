"""The text the tokenizer is trained on: a frozen snapshot (`corpus.json.xz`) of the
repository's own sources and docs and `sandboxes/tasks/`, so that no text is downloaded. A
tokenizer trained on the live tree would change its vocabulary, and every model built
before, with each edit. `python -m undertow.learner.modeldir.corpus --freeze` writes the
snapshot again, deterministically (files by relative path, the total capped): that changes
every tiny model's tokenizer, so update the pinned hash (tests/learner/test_modeldir.py).
"""

import argparse
import importlib.util
import json
import lzma
from dataclasses import dataclass
from pathlib import Path

PACKAGES = {"gateway": "undertow.gateway", "adapters": "undertow.adapters",
            "learner": "undertow.learner", "sandboxes": "undertow.sandboxes",
            "undertow": "undertow"}
TEXT_SUFFIXES = frozenset({".py", ".md"})
MAX_FILE_BYTES = 512 * 1024
MAX_CORPUS_BYTES = 8 * 1024 * 1024
FROZEN_CORPUS = Path(__file__).with_name("corpus.json.xz")


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


def freeze_corpus(out: Path = FROZEN_CORPUS, root: Path | None = None) -> int:
    """Write the corpus of the checkout at `root` (default: the installed packages' tree)
    to `out` as xz-compressed JSON ([{name, text}], sorted by name); return the number
    of files."""
    files = list_corpus(None if root is None else {folder: root / folder for folder in PACKAGES})
    documents = [{"name": corpus_file.name,
                  "text": corpus_file.path.read_bytes().decode("utf-8", errors="replace")}
                 for corpus_file in files]
    out.write_bytes(lzma.compress(json.dumps(documents, ensure_ascii=False).encode(), preset=9))
    return len(documents)


def read_frozen_corpus(path: Path = FROZEN_CORPUS) -> list[str]:
    """The texts of the frozen snapshot, in its (name) order."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall undertow, or write it with "
                                "`python -m undertow.learner.modeldir.corpus --freeze`")
    return [document["text"] for document in json.loads(lzma.decompress(path.read_bytes()))]


def main(argv: list[str] | None = None) -> int:
    # `__doc__` is None under `python -OO`.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--freeze", action="store_true",
                        help=f"write {FROZEN_CORPUS.name} from the repository's files")
    parser.add_argument("--root", type=Path, help="the checkout to read (default: this one)")
    args = parser.parse_args(argv)
    if not args.freeze:
        parser.error("nothing to do: pass --freeze")
    print(f"froze {freeze_corpus(root=args.root)} files into {FROZEN_CORPUS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
