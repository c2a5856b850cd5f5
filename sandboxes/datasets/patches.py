"""Reversing a git diff, for datasets whose `patch` introduces the bug instead of fixing it
(SWE-smith: docs/sandboxes.md#datasets). Text hunks only.
"""

import re

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")
_SWAPPED_HEADERS = {"old mode ": "new mode ", "new mode ": "old mode ",
                    "new file mode ": "deleted file mode ",
                    "deleted file mode ": "new file mode "}


def _range(start: str, count: str | None) -> str:
    return start if count is None else f"{start},{count}"


def _reverse_hunk_header(match: re.Match) -> tuple[str, int, int]:
    """The reversed header, and the original hunk's old and new line counts."""
    old_start, old_count, new_start, new_count, rest = match.groups()
    header = f"@@ -{_range(new_start, new_count)} +{_range(old_start, old_count)} @@{rest}"
    return header, int(old_count or 1), int(new_count or 1)


def _reverse_header(line: str, paths: list[str]) -> str:
    """One line of a file's header (before its hunks), reversed."""
    if line.startswith("diff --git "):
        old, new = line[len("diff --git "):].split(" b/", 1)
        return f"diff --git a/{new} b/{old.removeprefix('a/')}"
    for prefix, swapped in _SWAPPED_HEADERS.items():
        if line.startswith(prefix):
            return swapped + line[len(prefix):]
    if line.startswith("index "):
        hashes, _, mode = line[len("index "):].partition(" ")
        old, _, new = hashes.partition("..")
        return f"index {new}..{old}" + (f" {mode}" if mode else "")
    if line.startswith("rename from "):
        return "rename to " + line[len("rename from "):]
    if line.startswith("rename to "):
        return "rename from " + line[len("rename to "):]
    if line.startswith(("--- ", "+++ ")):
        paths.append(line[4:])
        if len(paths) == 2:  # both seen: write them swapped
            return f"--- {_side(paths[1], 'a/')}\n+++ {_side(paths[0], 'b/')}"
        return ""
    if line.startswith(("GIT binary patch", "Binary files ", "copy from ", "copy to ")):
        raise ValueError(f"cannot reverse a patch holding {line.split(' ')[0]!r} lines")
    return line


def _side(path: str, prefix: str) -> str:
    if path == "/dev/null":
        return path
    return prefix + path[2:] if path[:2] in ("a/", "b/") else path


def _ordered(lines: list[str]) -> list[str]:
    """`old mode` before `new mode`, `rename from` before `rename to`, as git writes them."""
    for first, second in (("old mode ", "new mode "), ("rename from ", "rename to ")):
        pair = [i for i, line in enumerate(lines) if line.startswith((first, second))]
        if len(pair) == 2 and lines[pair[0]].startswith(second):
            lines[pair[0]], lines[pair[1]] = lines[pair[1]], lines[pair[0]]
    return lines


def reverse_patch(patch: str) -> str:
    """The git diff that undoes `patch` (as `git apply -R` applies it)."""
    out: list[str] = []
    header: list[str] = []
    paths: list[str] = []
    num_old = num_new = 0
    for line in patch.splitlines():
        if num_old > 0 or num_new > 0:  # inside a hunk
            sign, text = line[:1], line[1:]
            if sign == "\\":
                out.append(line)
                continue
            num_old -= sign in (" ", "-")
            num_new -= sign in (" ", "+")
            out.append({"+": "-", "-": "+"}.get(sign, sign) + text)
            continue
        match = _HUNK.match(line)
        if match:
            out.extend(_ordered([h for h in header if h]))
            header, paths = [], []
            reversed_header, num_old, num_new = _reverse_hunk_header(match)
            out.append(reversed_header)
        elif line.startswith("\\"):
            out.append(line)
        else:
            if line.startswith("diff --git "):
                out.extend(_ordered([h for h in header if h]))
                header, paths = [], []
            header.append(_reverse_header(line, paths))
    out.extend(_ordered([h for h in header if h]))
    return "\n".join(out) + ("\n" if patch.endswith("\n") else "")
