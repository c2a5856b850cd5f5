"""Shared fixtures and markers.

Markers: `docker` skips only when no daemon can be reached (CI starts one);
`gpu` skips without CUDA; `vllm` skips only when the vLLM CPU build is absent
(`make test` installs it); `sglang` runs only given `--sglang-url`.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    parser.addoption("--sglang-url", default=None,
                     help="URL of a running SGLang server to run the engine conformance suite on")


def _docker_reachable() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    return subprocess.run([docker, "info"], capture_output=True).returncode == 0


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def vllm_python() -> Path | None:
    configured = os.environ.get("UNDERTOW_VLLM_PYTHON")
    candidate = Path(configured) if configured else REPO / ".venv-vllm" / "bin" / "python"
    return candidate if candidate.exists() else None


def pytest_collection_modifyitems(config, items):
    checks = {
        "docker": (_docker_reachable, "no Docker daemon reachable"),
        "gpu": (_cuda_available, "no CUDA device"),
        "vllm": (lambda: vllm_python() is not None, "vLLM CPU build not installed"),
        "sglang": (lambda: config.getoption("--sglang-url") is not None, "no --sglang-url"),
    }
    results = {}
    for item in items:
        for marker, (check, reason) in checks.items():
            if marker in item.keywords:
                if marker not in results:
                    results[marker] = check()
                if not results[marker]:
                    item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny model, built once per test session from the project's own code."""
    from undertow.learner.modeldir import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)
