"""Launchers start real engine servers and fail with errors that say what to do."""

import contextlib
import importlib.util
import shutil
from pathlib import Path

import pytest

from undertow.gateway.engines.launch import (
    BuiltinLauncher,
    SGLangLauncher,
    VLLMLauncher,
    launch_engine,
    start_engine,
)
from undertow.gateway.engines.protocol import EngineLaunchError

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_builtin_engine_starts_serves_and_stops(tiny_model_dir, tmp_path):
    async with launch_engine("builtin", tiny_model_dir, log_path=tmp_path / "engine.log") as engine:
        driver = engine.driver()
        try:
            assert await driver.health()
            assert (await driver.model_info()).weight_version == "0"
        finally:
            await driver.close()
        process = engine.process
    assert process.poll() is not None
    assert "listening on" in (tmp_path / "engine.log").read_text()


async def test_a_missing_model_directory_is_named(tmp_path):
    with pytest.raises(EngineLaunchError, match=r"does not exist.*undertow model init"):
        await start_engine("builtin", tmp_path / "no-such-model")


async def test_a_directory_without_config_is_not_a_model(tmp_path):
    with pytest.raises(EngineLaunchError, match=r"no config\.json"):
        await start_engine("builtin", tmp_path)


async def test_an_unknown_engine_kind_lists_the_known_ones(tiny_model_dir):
    with pytest.raises(EngineLaunchError, match="'builtin', 'sglang', 'vllm'"):
        await start_engine("tgi", tiny_model_dir)


async def test_a_missing_vllm_python_says_how_to_install_it(tiny_model_dir, tmp_path):
    launcher = VLLMLauncher(python=tmp_path / "bin" / "python")
    with pytest.raises(EngineLaunchError, match=r"vLLM.s python not found.*UNDERTOW_VLLM_PYTHON"):
        await start_engine(launcher, tiny_model_dir)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang installed")
async def test_a_missing_sglang_says_how_to_install_it(tiny_model_dir):
    with pytest.raises(EngineLaunchError, match=r"SGLang is not installed.*undertow\[gpu\]"):
        await start_engine(SGLangLauncher(), tiny_model_dir)


async def test_an_engine_that_exits_early_shows_the_end_of_its_log(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "config.json").write_text("{this is not json")
    with pytest.raises(EngineLaunchError) as error:
        await start_engine("builtin", broken, log_path=tmp_path / "engine.log")
    message = str(error.value)
    assert "exited with code" in message
    assert "Traceback" in message or "error" in message.lower()
    assert message.endswith((tmp_path / "engine.log").read_text().splitlines()[-1])


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if text.encode() in cmdline.read_bytes():
                found.append(cmdline.parent.name)
    return found


async def test_an_engine_that_is_not_ready_in_time_is_stopped(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "slow-to-start"
    shutil.copytree(tiny_model_dir, model_dir)
    launcher = BuiltinLauncher(ready_timeout_s=0.01)
    with pytest.raises(EngineLaunchError, match="was not ready after"):
        await start_engine(launcher, model_dir, log_path=tmp_path / "engine.log")
    assert _processes_mentioning(str(model_dir)) == []
