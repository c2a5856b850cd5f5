"""Build a :class:`Config` from text: the lexer's lines, values, and sections.

A section may be opened more than once (its keys are merged), but a key may
only be given once per section, and a name cannot be both a key and a section.
"""

from pathlib import Path

from inilike.config import Config
from inilike.errors import ParseError
from inilike.lexer import logical_lines
from inilike.values import parse_value


def loads(text: str) -> Config:
    """Parse ``text`` and return its :class:`Config`."""
    root: dict = {}
    table = root
    for line in logical_lines(text):
        if line.kind == "section":
            table = _open_section(root, line.name, line.line_no)
            continue
        if line.name in table:
            what = "section" if isinstance(table[line.name], dict) else "key"
            raise ParseError(f"{what} '{line.name}' is already defined", line.line_no)
        table[line.name] = parse_value(line.value, line.line_no, line.value_column)
    return Config(root)


def load(path: str | Path, encoding: str = "utf-8") -> Config:
    """Read and parse the file at ``path``."""
    return loads(Path(path).read_text(encoding=encoding))


def _open_section(root: dict, name: str, line_no: int) -> dict:
    table = root
    for part in name.split("."):
        child = table.setdefault(part, {})
        if not isinstance(child, dict):
            raise ParseError(f"'{part}' is a key, it cannot also be a section", line_no)
        table = child
    return table
