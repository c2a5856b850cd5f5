"""SGLang 0.5.23's own request and reply types, read from its wheel without installing it.

SGLang itself does not import on a machine without CUDA's stack (`sglang.srt` imports
triton, torchvision, sentencepiece and a score of others before `io_struct` loads), but two
of its files say what its HTTP API accepts, and both can be read here:
- `sglang/api/v1/api_types.py`, generated from SGLang's API schema, needs only msgspec:
  `GenerateRequest.from_json_value(body)` is the check `/generate` runs on every body
  (`srt/entrypoints/api_contract.py`), and its `SamplingParams` rejects unknown keys;
  `GenerateResponse` describes the replies;
- `sglang/srt/managers/io_struct.py`, the msgspec structs the control endpoints take
  (`PauseGenerationReqInput`, `UpdateWeightFromDiskReqInput`, ...): read as source (its
  imports need torch and zmq), for each struct's fields, which have defaults, and the values
  of `Literal` fields.

The wheel is found at `$UNDERTOW_SGLANG_WHEEL`, else in `.cache/sglang/` (`make
setup-sglang-types` downloads it there); `find_wheel()` is None when there is none.
"""

from __future__ import annotations

import ast
import os
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEEL_PATTERN = "sglang-0.5.23-*.whl"
API_TYPES = "sglang/api/v1/api_types.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"


def find_wheel() -> Path | None:
    configured = os.environ.get("UNDERTOW_SGLANG_WHEEL")
    if configured:
        return Path(configured)
    return next(iter(sorted((REPO / ".cache" / "sglang").glob(WHEEL_PATTERN))), None)


def read_source(wheel: Path, member: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(member).decode()


def load_api_types(wheel: Path) -> types.ModuleType:
    """`sglang.api.v1.api_types`, executed from the wheel's source (it imports msgspec only)."""
    module = types.ModuleType("sglang_api_v1_api_types")
    module.__file__ = f"{wheel}!/{API_TYPES}"
    sys.modules[module.__name__] = module  # msgspec resolves the annotations through it
    exec(compile(read_source(wheel, API_TYPES), module.__file__, "exec"), module.__dict__)
    return module


@dataclass(frozen=True)
class StructField:
    """One field of an io_struct struct: whether it must be given, and its `Literal` values."""

    required: bool
    choices: tuple | None


class IoStructs:
    """The structs of `io_struct.py`, from its syntax tree: `fields(name)` are a struct's
    fields, its bases' (those defined in the file) included."""

    def __init__(self, source: str):
        self._classes = {node.name: node for node in ast.walk(ast.parse(source))
                         if isinstance(node, ast.ClassDef)}

    def fields(self, name: str) -> dict[str, StructField]:
        node = self._classes[name]
        fields: dict[str, StructField] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in self._classes:
                fields.update(self.fields(base.id))
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                fields[statement.target.id] = StructField(
                    required=statement.value is None, choices=_literal(statement.annotation))
        return fields

    def problems(self, name: str, body: dict) -> list[str]:
        """Why `body` is not a valid `name` (unknown or missing fields, values outside a
        `Literal`); empty when it is."""
        fields = self.fields(name)
        problems = [f"{name} has no field {key!r}" for key in body if key not in fields]
        problems += [f"{name} needs {key!r}" for key, spec in fields.items()
                     if spec.required and key not in body]
        problems += [f"{name}.{key} is one of {spec.choices}, not {body[key]!r}"
                     for key, spec in fields.items()
                     if spec.choices is not None and key in body and body[key] not in spec.choices]
        return problems


def _literal(annotation: ast.expr) -> tuple | None:
    if (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)
            and annotation.value.id == "Literal"):
        items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [
            annotation.slice]
        return tuple(item.value for item in items if isinstance(item, ast.Constant))
    return None
