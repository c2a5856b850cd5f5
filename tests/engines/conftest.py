"""Fixtures for the drivers' tests and the built-in engine's (`tests/builtin_engine/`
imports them): the built-in engine, started as a real server process.

`builtin_engine_url` is one engine on the tiny model for a folder's tests (the conformance
suite and the built-in engine's tests each start one); tests that change an engine's state for
good (weights, tiny cache bound) start their own with the `start_engine` fixture.
"""

import contextlib
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

STARTUP_TIMEOUT_S = 120.0
LISTENING = "undertow engine listening on "


def _wait_healthy(url: str, process: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the engine exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the engine at {url} did not become healthy")


@contextlib.contextmanager
def start_builtin_engine(model_dir: Path, *args: str):
    """Run `undertow engine serve --model model_dir --port 0 num_threads=1 *args` (`args`:
    more KEY=VALUE overrides of its `EngineConfig`); yield its base URL."""
    command = [sys.executable, "-m", "undertow.cli", "engine", "serve", "--model",
               str(model_dir), "--port", "0", "num_threads=1", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        line = process.stdout.readline()
        if not line.startswith(LISTENING):
            raise RuntimeError(f"the engine did not print its address; it printed {line!r}")
        url = line[len(LISTENING):].strip()
        _wait_healthy(url, process, deadline)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


@pytest.fixture(scope="session")
def builtin_engine_url(tiny_model_dir):
    """Base URL of a built-in engine serving the tiny model for the whole session."""
    with start_builtin_engine(tiny_model_dir) as url:
        yield url


@pytest.fixture(scope="session")
def other_tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny model with the weights of another seed (same architecture and tokenizer)."""
    from undertow.learner.modeldir import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("models") / "tiny-seed1", size="tiny", seed=1)


@pytest.fixture(scope="session")
def start_engine():
    """`start_engine(model_dir, *flags)`: a context manager running a dedicated engine."""
    return start_builtin_engine
