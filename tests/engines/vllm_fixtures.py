"""A real vLLM server on the tiny model, for the tests that run through the `vllm` driver.

Import the fixture into a test module (`from tests.engines.vllm_fixtures import
vllm_engine_url  # noqa: F401`) and mark the tests `vllm`, so that they skip where the vLLM CPU
build is absent. The server is started once per session (about 1-2 minutes here) with the
`vllm` launcher of `undertow.gateway.engines.launch`.
"""

import pytest_asyncio

from tests.conftest import vllm_python
from undertow.gateway.engines.launch import VLLMLauncher, start_engine


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine_url(tiny_model_dir, tmp_path_factory):
    """Base URL of a vLLM server serving the tiny model for the whole session."""
    launcher = VLLMLauncher(python=vllm_python())
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    engine = await start_engine(launcher, tiny_model_dir, log_path=log_path)
    try:
        yield engine.url
    finally:
        await engine.stop()
