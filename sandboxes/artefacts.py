"""Build artefacts: files that running a repository's code or tests writes into it, and that
are not the agent's work; kept out of a session's diff (docs/sandboxes.md#containers). The patterns
are gitignore lines; `is_build_artefact` reads them the same way for a path.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from pathlib import PurePosixPath

# A trailing "/" matches a folder at any depth; the others match a file name at any depth.
BUILD_ARTEFACTS = ("__pycache__/", "*.py[cod]", "*$py.class", ".pytest_cache/", "*.egg-info/",
                   ".eggs/", ".mypy_cache/", ".ruff_cache/", ".hypothesis/", ".tox/", ".nox/",
                   ".coverage", ".coverage.*")

_SECTION = re.compile(r"^diff --git ", re.MULTILINE)
_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$")


def is_build_artefact(path: str) -> bool:
    """Whether `path` (relative to the repository) matches one of `BUILD_ARTEFACTS`."""
    parts = PurePosixPath(path).parts
    for pattern in BUILD_ARTEFACTS:
        if pattern.endswith("/"):
            if any(fnmatchcase(part, pattern[:-1]) for part in parts[:-1]):
                return True
        elif parts and fnmatchcase(parts[-1], pattern):
            return True
    return False


def without_new_artefacts(diff: str) -> tuple[str, int]:
    """`diff` (a git diff) without the files it adds that are build artefacts, and how
    many it dropped. Changes to files that existed before are kept, whatever their name;
    text before the first `diff --git` (a diff cut at its start) is kept as it is."""
    starts = [match.start() for match in _SECTION.finditer(diff)]
    if not starts:
        return diff, 0
    pieces = [diff[:starts[0]]]
    num_dropped = 0
    for start, end in zip(starts, [*starts[1:], len(diff)], strict=True):
        section = diff[start:end]
        header, _, body = section.partition("\n")
        paths = _HEADER.match(header)
        if paths and body.startswith("new file mode") and is_build_artefact(paths.group(2)):
            num_dropped += 1
            continue
        pieces.append(section)
    return "".join(pieces), num_dropped
