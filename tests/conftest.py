"""Shared fixtures and markers.

Markers: `docker` skips only when no daemon can be reached (CI starts one);
`gpu` skips without CUDA; `vllm` skips only when the vLLM CPU build is absent
(`make test` installs it); `sglang` runs only given `--sglang-url`. A test that uses a
fixture of `FIXTURE_MARKERS` (directly or through another fixture) gets that fixture's
marker here, so that `make test-fast` (the edit loop's tier) can leave it out by marker.

The expensive servers that tests of several modules use live here, once per session: a
fixture imported into a test module (`from tests.x import fixture`) is that module's own
fixture, and a session-scoped one imported into four modules starts four times.
"""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import pytest_asyncio

REPO = Path(__file__).resolve().parents[1]
TRAIN_TIMEOUT_S = 600

# The elastic pool run (`elastic_pool_run`): `undertow train` on three CPU cells with the
# elastic policy and the paced scripted rollouts (tests/e2e/paced_rollouts.py), one slow
# session per group of 4, two steps.
POOL_RUN_NUM_TURNS = 2
ELASTIC_POOL_RUN = (
    "learner.num_steps=2", "learner.group_size=4", "learner.lr=0.001",
    "rollout.source=tests.e2e.paced_rollouts:make_run_group",
    f"rollout.scaffold_options={{num_turns: {POOL_RUN_NUM_TURNS}, max_tokens: 8, "
    "tool_latency_s: [0.0, 0.0, 0.5, 4.0]}",
    "pool.policy=elastic", "pool.num_cells=3", "pool.num_session_slots=2")


def pytest_addoption(parser):
    parser.addoption("--sglang-url", default=None,
                     help="URL of a running SGLang server to run the engine conformance suite on")
    parser.addoption("--sglang-model", default=None,
                     help="the model directory the --sglang-url server runs (default: the tiny "
                          "model of seed 0, built by the tests)")


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


# What a fixture needs, as a marker: every test that uses one of these gets the marker, also
# one that names it in a parameter for `request.getfixturevalue` (test_model_check.py).
FIXTURE_MARKERS = {
    "docker_connection": "docker",  # tests/sandboxes/conftest.py
    "connection": "docker",  # tests/adapters/conftest.py
    "second_daemon": "docker",  # tests/sandboxes/test_hosts.py
    "vllm_engine_url": "vllm",
    "smollm2_dir": "pretrained",
    "qwen_coder_dir": "pretrained",
}


def fixtures_named(item) -> set[str]:
    """The fixtures `item` uses (through others too) and the string values of its parameters,
    which name the fixtures a test or fixture gets with `request.getfixturevalue`."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    return {*getattr(item, "fixturenames", ()), *(p for p in params if isinstance(p, str))}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture in FIXTURE_MARKERS.keys() & fixtures_named(item):
            item.add_marker(FIXTURE_MARKERS[fixture])
    checks = {
        "docker": (_docker_reachable, "no Docker daemon reachable"),
        "gpu": (_cuda_available, "no CUDA device"),
        "vllm": (lambda: vllm_python() is not None, "vLLM CPU build not installed"),
        "sglang": (lambda: config.getoption("--sglang-url") is not None, "no --sglang-url"),
    }
    results = {}
    for item in items:
        for marker, (check, reason) in checks.items():
            # a marker, not a keyword: a parameter's id (`[sglang]`) is a keyword too
            if item.get_closest_marker(marker) is not None:
                if marker not in results:
                    results[marker] = check()
                if not results[marker]:
                    item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny model, built once per test session from the project's own code."""
    from undertow.learner.modeldir import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)


# Pretrained model directories, converted once by `make setup-models` (`undertow model
# fetch`) into the repository's cache and reused by every test session.
MODELS_CACHE = REPO / ".cache" / "models"


FETCH_TIMEOUT_S = 1800


def pretrained_dir(name: str) -> Path:
    """`MODELS_CACHE / name`, fetched first when it is missing (as `make setup-models` does),
    so that pytest alone works on a fresh machine. Concurrent fetches (xdist workers) are
    safe: each builds in its own temporary directory and the first complete one is kept."""
    path = MODELS_CACHE / name
    if not (path / "undertow_fetch.json").is_file() and not path.is_symlink():
        subprocess.run([sys.executable, "-m", "undertow.cli", "model", "fetch", name,
                        "--out", str(path)], check=True, cwd=REPO, timeout=FETCH_TIMEOUT_S)
    return path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (LlamaForCausalLM, its own
    tokenizer and chat template, float32 weights dequantised from its Q4_1 GGUF)."""
    return pretrained_dir("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen_coder_dir() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct as a Hugging Face directory (Qwen2ForCausalLM, untied
    lm_head as its GGUF stores it, float32 weights dequantised from the GGUF)."""
    return pretrained_dir("qwen2.5-coder-0.5b-instruct")


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine_url(tiny_model_dir, tmp_path_factory):
    """Base URL of one vLLM server on the tiny model (the `vllm` launcher of
    `undertow.gateway.engines.launch`; about a minute to start here), shared by every
    `vllm`-marked test of the session. A test that changes its state (weights, weight
    version, pause) restores it before it ends; one that needs other flags starts its own."""
    from undertow.gateway.engines.launch import VLLMLauncher, start_engine

    launcher = VLLMLauncher(python=vllm_python())
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    engine = await start_engine(launcher, tiny_model_dir, log_path=log_path)
    try:
        yield engine.url
    finally:
        await engine.stop()


def run_train(arguments: list[str], log: Path, expected_code: int = 0) -> None:
    """Runs `undertow train ARGUMENTS` to its end, from the repository (on its PYTHONPATH,
    for the tests' rollout sources); fails the test with its log if it does not exit with
    `expected_code`."""
    command = [sys.executable, "-m", "undertow.cli", "train", *arguments]
    with open(log, "wb") as handle:
        process = subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True,
                                   env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        code = process.wait(timeout=TRAIN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"undertow train did not finish; its log:\n{log.read_text()[-3000:]}")
    assert code == expected_code, log.read_text()[-3000:]


@pytest.fixture(scope="session")
def elastic_pool_run(tiny_model_dir, tmp_path_factory) -> Path:
    """The run directory of a finished `ELASTIC_POOL_RUN` on the tiny model, run once per
    session (about a minute) for the two tests that check it: tests/e2e/test_train_pool.py,
    which then resumes it, and tests/ui/test_viewer.py, which draws it. It stays as the run
    left it: a test copies it (`shutil.copytree`) before it resumes or serves it."""
    run_dir = tmp_path_factory.mktemp("elastic-pool") / "run"
    run_train(["--run-dir", str(run_dir), f"run.model_dir={tiny_model_dir}",
               *ELASTIC_POOL_RUN], run_dir.parent / "train.log")
    return run_dir
