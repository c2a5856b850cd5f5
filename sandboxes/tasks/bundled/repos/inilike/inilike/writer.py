"""Write a :class:`Config` back as text that :func:`inilike.loads` reads identically.

Values are written raw: ``${...}`` references stay references. Every string
is written double-quoted so that text such as ``"true"`` or ``"12"`` stays a
string when it is read back.
"""

from inilike.config import Config

WRITE_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r", "\0": "\\0"}


def dumps(config: Config) -> str:
    """Return the text of ``config``: root keys first, then each section."""
    lines: list[str] = []
    _write_table(lines, (), config.to_dict(interpolate=False))
    return "\n".join(lines) + "\n" if lines else ""


def format_value(value: object) -> str:
    """Return ``value`` as inilike source text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, list):
        return "[" + ", ".join(format_value(item) for item in value) + "]"
    raise TypeError(f"cannot write a value of type {type(value).__name__}: {value!r}")


def quote(text: str) -> str:
    """Return ``text`` as a double-quoted string with escapes."""
    chars = []
    for char in text:
        if char in WRITE_ESCAPES:
            chars.append(WRITE_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            chars.append(f"\\u{ord(char):04x}")
        else:
            chars.append(char)
    return '"' + "".join(chars) + '"'


def _write_table(lines: list[str], path: tuple[str, ...], table: dict) -> None:
    # A section's own keys must come before its subsections: once a
    # "[a.b]" header is written, every following key belongs to a.b.
    values = [(key, value) for key, value in table.items() if not isinstance(value, dict)]
    tables = [(key, value) for key, value in table.items() if isinstance(value, dict)]
    if path and (values or not tables):
        if lines:
            lines.append("")
        lines.append(f"[{'.'.join(path)}]")
    for key, value in values:
        lines.append(f"{key} = {format_value(value)}")
    for key, child in tables:
        _write_table(lines, (*path, key), child)
