"""`undertow doctor`: what a run or the test suite needs, and the one command that fixes each gap.

Each check is a small function returning a `Check`; one that is not `required` for the
chosen purpose only informs. The external programs come from `system-packages.txt`, the
one list the Makefile installs from, so the doctor and the set-up never disagree.
"""

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from undertow.gateway.trees.template_env import read_chat_templates

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PACKAGES = REPO / "system-packages.txt"
MIN_IMAGE_DISK_BYTES = 5 * 2**30
# What the test suite writes at once in its temporary directory is bounded by its largest
# test, a SmolLM2 run (a passing test's files are removed when it ends, pyproject.toml);
# with less free, tests fail with "No space left on device" far from the cause.
MIN_TEST_DISK_BYTES = 5 * 2**30
PURPOSES = ("run", "test")


@dataclass(frozen=True)
class Check:
    """One finding. `fix` is the command that fixes it; empty when `ok`."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True

    def line(self) -> str:
        mark = "ok  " if self.ok else ("FAIL" if self.required else "note")
        text = f"{mark} {self.name}: {self.detail}"
        return f"{text}\n       fix: {self.fix}" if self.fix and not self.ok else text


def read_system_packages(path: Path = SYSTEM_PACKAGES) -> dict[str, str]:
    """Program -> Debian package, from the list the Makefile installs."""
    programs = {}
    for line in path.read_text().splitlines():
        words = line.split()
        if len(words) == 2 and not line.startswith("#"):
            programs[words[0]] = words[1]
    return programs


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    return Check("python", sys.version_info >= (3, 11), f"{version} at {sys.executable}",
                 "use Python 3.11 or newer (`make setup` makes .venv from python3)")


def check_torch() -> Check:
    if importlib.util.find_spec("torch") is None:
        return Check("torch", False, "not installed",
                     "make setup (CPU: pip install torch==2.13.0 first)")
    import torch

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    return Check("torch", True, f"{torch.__version__} ({build} build)")


def check_programs(path: Path = SYSTEM_PACKAGES) -> list[Check]:
    if not path.exists():
        return [Check("system programs", True, f"{path.name} not found: not a source checkout; "
                      "skipped", required=False)]
    checks = []
    for program, package in read_system_packages(path).items():
        found = shutil.which(program)
        checks.append(Check(program, found is not None, found or "not on the PATH",
                            f"apt-get install {package}  (as root; or `make system-packages`)"))
    return checks


def _docker_info(docker_url: str | None) -> dict | str:
    """The daemon's `docker info`, or why it cannot be had (through the docker CLI, which
    `make system-packages` installs, so that a dead socket leaves nothing open here)."""
    docker = shutil.which("docker")
    if docker is None:
        return "the docker CLI is not on the PATH"
    host = ["-H", docker_url] if docker_url else []
    result = subprocess.run([docker, *host, "info", "--format", "{{json .}}"],
                            capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        return (result.stderr.strip().splitlines() or ["docker info failed"])[-1][:200]
    return json.loads(result.stdout)


def check_docker(info: dict | str) -> list[Check]:
    if isinstance(info, str):
        return [Check("docker daemon", False, f"not reachable ({info})",
                      "make docker-daemon  (as root; or start dockerd)")]
    driver = info.get("Driver", "?")
    checks = [Check("docker daemon", True, f"reachable, server {info.get('ServerVersion', '?')}, "
                    f"storage driver {driver}")]
    if driver == "vfs":
        checks.append(Check("docker storage", False, "vfs copies every layer in full: image "
                            "builds are slow and large", "run dockerd with overlay2",
                            required=False))
    root = Path(info.get("DockerRootDir", "/var/lib/docker"))
    if root.exists():
        free = shutil.disk_usage(root).free
        checks.append(Check("disk for images", free >= MIN_IMAGE_DISK_BYTES,
                            f"{free / 2**30:.1f} GiB free under {root}",
                            f"free at least {MIN_IMAGE_DISK_BYTES / 2**30:.0f} GiB there "
                            "(`undertow sandbox gc`, `docker image prune`)"))
    return checks


def check_test_disk(temp_dir: Path) -> Check:
    free = shutil.disk_usage(temp_dir).free
    return Check("disk for tests", free >= MIN_TEST_DISK_BYTES,
                 f"{free / 2**30:.1f} GiB free under {temp_dir}",
                 f"free at least {MIN_TEST_DISK_BYTES / 2**30:.0f} GiB there, or point TMPDIR "
                 "at a disk that has it (pytest writes model checkpoints under it)")


def check_base_image(docker_url: str | None) -> Check:
    from undertow.sandboxes.base_image import BaseImageRecipe, find_base_image
    from undertow.sandboxes.connection import connect

    recipe = BaseImageRecipe()
    with connect(docker_url) as connection:
        found = find_base_image(connection.client, recipe)
    if found is not None:
        return Check("base image", True, f"{recipe.tag} (recipe {recipe.digest()})")
    if shutil.which("debootstrap") is None:
        return Check("base image", False, f"{recipe.tag} absent and debootstrap missing",
                     "apt-get install debootstrap, then `undertow sandbox build-base`")
    return Check("base image", False, f"{recipe.tag} absent: built on first use (a few "
                 "minutes, once)", "undertow sandbox build-base  (to build it now)",
                 required=False)


def check_agents() -> list[Check]:
    bin_dir = REPO / ".cache" / "agents" / "node_modules" / ".bin"
    return [Check(f"{name} CLI", (bin_dir / name).exists() or shutil.which(name) is not None,
                  str(bin_dir / name), "make setup-agents") for name in ("claude", "codex")]


def check_openhands() -> Check:
    python = REPO / ".venv-openhands" / "bin" / "python"
    if not python.exists():
        return Check("OpenHands", False, f"{python} missing", "make setup-openhands")
    found = subprocess.run([str(python), "-c", "import openhands.core.main"],
                           capture_output=True, text=True, timeout=120)
    return Check("OpenHands", found.returncode == 0,
                 "importable" if found.returncode == 0 else found.stderr.strip()[-200:],
                 "make setup-openhands")


def check_vllm(vllm_python: str | None) -> Check:
    from undertow.gateway.engines.launch import default_vllm_python

    python = Path(vllm_python) if vllm_python else default_vllm_python()
    if not python.exists():
        return Check("vLLM", False, f"{python} missing", "make setup-vllm")
    found = subprocess.run([str(python), "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True, timeout=60)
    return Check("vLLM", found.returncode == 0, f"{python}", "make setup-vllm")


def check_model_dir(model_dir: Path) -> Check:
    """A Hugging Face model directory: config, tokenizer, chat template, safetensors weights."""
    missing = [name for name in ("config.json", "tokenizer.json") if not (model_dir / name)
               .exists()]
    if not list(model_dir.glob("*.safetensors")):
        missing.append("*.safetensors")
    try:
        template = read_chat_templates(model_dir).select(with_tools=False)
    except ValueError as error:
        missing.append(f"a readable chat template ({error})")
    else:
        if template is None:
            missing.append("a chat template (chat_template.jinja or tokenizer_config.json)")
    return Check(f"model {model_dir}", not missing,
                 "complete" if not missing else f"missing {', '.join(missing)}",
                 f"undertow model init --out {model_dir}  (or copy the model's files there)")


def run_checks(purpose: str, model_dir: Path | None, docker_url: str | None,
               vllm_python: str | None) -> list[Check]:
    """Every check that `purpose` ("run" or "test") needs, in the order they are shown."""
    if purpose not in PURPOSES:
        raise ValueError(f"--for {purpose!r}: choose one of {', '.join(PURPOSES)}")
    info = _docker_info(docker_url)
    steps: list[Callable[[], Check | list[Check]]] = [
        check_python, check_torch, check_programs, lambda: check_docker(info)]
    if not isinstance(info, str):
        steps.append(lambda: check_base_image(docker_url))
    if purpose == "test":
        steps += [lambda: check_test_disk(Path(tempfile.gettempdir())), check_agents,
                  check_openhands, lambda: check_vllm(vllm_python)]
    if model_dir is not None:
        steps.append(lambda: check_model_dir(model_dir))
    checks: list[Check] = []
    for step in steps:
        found = step()
        checks.extend(found if isinstance(found, list) else [found])
    return checks


def main(purpose: str, model_dir: Path | None, docker_url: str | None,
         vllm_python: str | None) -> int:
    checks = run_checks(purpose, model_dir, docker_url, vllm_python)
    for check in checks:
        print(check.line())
    failed = [check.name for check in checks if check.required and not check.ok]
    if failed:
        print(f"undertow doctor: missing for `{purpose}`: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"undertow doctor: ready to {purpose}")
    return 0
