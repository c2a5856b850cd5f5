"""Launchers start real engine servers and fail with errors that say what to do."""

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.engines.sglang_types import REPO, find_wheel
from undertow.cells.config import CellPoolConfig
from undertow.cells.pool import cell_launcher
from undertow.gateway.engines.launch import (
    DETERMINISTIC_ATTENTION_BACKENDS,
    LAUNCHERS,
    BuiltinLauncher,
    SGLangLauncher,
    VLLMLauncher,
    kv_share_args,
    launch_engine,
    node_launchers,
    sharing_kv,
    start_engine,
    start_engines,
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


async def _left_running(text: str) -> list[str]:
    """The processes mentioning `text` once stopped ones are gone: the server has exited
    when `stop` returns, but its watchdog (`lifetime.py`), SIGKILLed with its group, may
    take a moment longer to be reaped on a loaded machine (up to 10 s here)."""
    for _ in range(100):
        if not _processes_mentioning(text):
            return []
        await asyncio.sleep(0.1)
    return _processes_mentioning(text)


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
    assert await _left_running(str(model_dir)) == []


def _flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


async def test_sglang_command_carries_tp_size_and_memory_fraction(tmp_path):
    launcher = SGLangLauncher(tp_size=4, mem_fraction_static=0.7)
    command = launcher.command(tmp_path, 30000)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    assert _flag(command, "--tp-size") == "4"
    assert _flag(command, "--mem-fraction-static") == "0.7"
    assert _flag(command, "--port") == "30000"
    assert "--base-gpu-id" not in command  # no GPUs named: SGLang's default placement
    assert launcher.environment().get("CUDA_VISIBLE_DEVICES") == \
        os.environ.get("CUDA_VISIBLE_DEVICES")
    default = SGLangLauncher().command(tmp_path, 30000)
    assert "--tp-size" not in default and "--mem-fraction-static" not in default


async def test_node_launchers_split_the_gpus_of_a_node_into_engines(tmp_path):
    launchers = node_launchers(8, tp_size=2, mem_fraction_static=0.8, weight_version="3")
    assert len(launchers) == 4
    visible = [launcher.environment()["CUDA_VISIBLE_DEVICES"] for launcher in launchers]
    assert visible == ["0,1", "2,3", "4,5", "6,7"]
    for launcher in launchers:
        command = launcher.command(tmp_path, 30000)
        assert _flag(command, "--tp-size") == "2"
        assert _flag(command, "--base-gpu-id") == "0"
        assert _flag(command, "--mem-fraction-static") == "0.8"
        assert _flag(command, "--weight-version") == "3"
        assert launcher.environment()["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    assert len(node_launchers(8, tp_size=3)) == 2
    assert [launcher.gpu_ids for launcher in node_launchers(4, num_engines=2)] == [(0,), (1,)]


@pytest.mark.parametrize("options, message", [
    ({"num_gpus": 2, "tp_size": 4}, "do not fit in 2 GPUs"),
    ({"num_gpus": 4, "tp_size": 2, "num_engines": 3}, "3 engines of tp_size=2"),
    ({"num_gpus": 0}, "num_gpus=0"),
])
async def test_node_launchers_refuse_engines_that_do_not_fit(options, message):
    with pytest.raises(ValueError, match=message):
        node_launchers(**options)


async def test_sglang_launcher_validates_its_placement():
    with pytest.raises(ValueError, match="tp_size=0"):
        SGLangLauncher(tp_size=0)
    with pytest.raises(ValueError, match=r"mem_fraction_static=1\.5"):
        SGLangLauncher(mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="must name tp_size=2 GPUs"):
        SGLangLauncher(tp_size=2, gpu_ids=(0,))


async def test_start_engines_starts_several_and_stops_all_when_one_fails(tiny_model_dir, tmp_path):
    engines = await start_engines([BuiltinLauncher(), BuiltinLauncher(weight_version="7")],
                                  tiny_model_dir, log_dir=tmp_path)
    try:
        assert len({engine.url for engine in engines}) == 2
        versions = []
        for engine in engines:
            driver = engine.driver()
            try:
                versions.append((await driver.model_info()).weight_version)
            finally:
                await driver.close()
        assert versions == ["0", "7"]
        assert (tmp_path / "engine-1.log").exists()
    finally:
        for engine in engines:
            await engine.stop()
    model_dir = tmp_path / "shared-name"
    shutil.copytree(tiny_model_dir, model_dir)
    with pytest.raises(EngineLaunchError, match="not ready after"):
        await start_engines([BuiltinLauncher(), BuiltinLauncher(ready_timeout_s=0.01)],
                            model_dir)
    assert await _left_running(str(model_dir)) == []


@pytest.mark.parametrize("kind", sorted(LAUNCHERS))
async def test_each_engine_kind_configures_its_cells_and_engine_hosts_itself(kind):
    """What differs between engine kinds is the launcher class's own (`uses_gpus`,
    `for_cell`, `for_host`): no caller branches on the kind's name."""
    launcher = LAUNCHERS[kind].for_cell(weight_version="3", num_threads=2, gpu_ids=(4,))
    assert type(launcher) is LAUNCHERS[kind] and launcher.weight_version == "3"
    assert isinstance(LAUNCHERS[kind].uses_gpus, bool)
    remote = launcher.for_host("10.0.0.7", [4])
    assert remote.extra_args == (*launcher.extra_args, "--host", "0.0.0.0")
    assert launcher.for_host("127.0.0.1", [4]).extra_args == launcher.extra_args
    assert LAUNCHERS["sglang"].uses_gpus and not LAUNCHERS["builtin"].uses_gpus


def _sglang_judges(commands: list[list[str]]) -> dict:
    """What SGLang 0.5.23's own parser and deterministic-inference rule make of each
    command's arguments (`sglang_server_args.py`, run from the wheel in a process of its own)."""
    wheel = find_wheel()
    if wheel is None or not wheel.exists():
        pytest.skip("SGLang 0.5.23's wheel is not in .cache/sglang: run `make "
                    "setup-sglang-types` (or set UNDERTOW_SGLANG_WHEEL)")
    arguments = [command[command.index("sglang.launch_server") + 1:] for command in commands]
    judged = subprocess.run([sys.executable, "-m", "tests.engines.sglang_server_args", str(wheel)],
                            input=json.dumps(arguments), capture_output=True, text=True,
                            check=True, cwd=REPO, timeout=300)
    return json.loads(judged.stdout)


async def test_sglang_commands_pass_sglangs_own_argument_rules(tmp_path):
    """On a CPU: `--device cpu --attention-backend torch_native`, without the deterministic
    flag SGLang refuses there; on GPUs the flag wherever the backend allows it."""
    launchers = {
        "cpu": SGLangLauncher(device="cpu", weight_version="4"),
        "gpu": SGLangLauncher(device=None),
        "gpu cell": node_launchers(4, tp_size=2, mem_fraction_static=0.8)[1],
        "gpu triton": SGLangLauncher(device=None, attention_backend="triton"),
        "gpu torch_native": SGLangLauncher(device=None, attention_backend="torch_native"),
        "cpu on request": SGLangLauncher(device="cpu", deterministic=False),
    }
    judged = _sglang_judges([launcher.command(tmp_path, 30000)
                             for launcher in launchers.values()])
    results = dict(zip(launchers, judged["results"], strict=True))
    assert {name: result["error"] for name, result in results.items()} == dict.fromkeys(
        launchers)
    assert set(judged["deterministic_backends"]) == set(DETERMINISTIC_ATTENTION_BACKENDS)
    cpu = results["cpu"]
    assert (cpu["device"], cpu["attention_backend"], cpu["weight_version"]) == (
        "cpu", "torch_native", "4")
    assert launchers["cpu"].environment()["SGLANG_USE_CPU_ENGINE"] == "1"
    assert "SGLANG_USE_CPU_ENGINE" not in launchers["gpu"].environment()
    deterministic = {name: result["enable_deterministic_inference"]
                     for name, result in results.items()}
    assert deterministic == {"cpu": False, "gpu": True, "gpu cell": True, "gpu triton": True,
                             "gpu torch_native": False, "cpu on request": False}
    assert deterministic == {name: launcher.deterministic_inference
                             for name, launcher in launchers.items()}


async def test_kv_share_dir_adds_hicache_shared_storage_flags_sglang_accepts(tmp_path):
    """Every server of a pool with `kv_share_dir` gets the same HiCache flags, each parsed by
    SGLang 0.5.23's own parser to what docs/migration-sglang.md says they do."""
    shared = tmp_path / "kv"
    launchers = [replace(launcher, kv_share_dir=shared)
                 for launcher in node_launchers(4, tp_size=2, mem_fraction_static=0.8)]
    commands = [launcher.command(tmp_path / f"ckpt{i}", 30000 + i)
                for i, launcher in enumerate(launchers)]
    judged = _sglang_judges([*commands, SGLangLauncher(device=None).command(tmp_path, 30000)])
    *shared_results, plain = judged["results"]
    assert [result["error"] for result in judged["results"]] == [None] * 3
    expected = {"enable_hierarchical_cache": True, "hicache_write_policy": "write_through",
                "hicache_storage_backend": "file", "file_storage_path": str(shared),
                "hicache_storage_backend_extra_config": '{"prefetch_threshold": 64}',
                "hicache_storage_prefetch_policy": "wait_complete", "page_size": 64,
                "served_model_name": "undertow-policy"}
    assert [result["hicache"] for result in shared_results] == [expected] * 2
    assert plain["hicache"]["hicache_storage_backend"] is None
    assert not plain["hicache"]["enable_hierarchical_cache"]
    assert plain["hicache"]["served_model_name"] is None


async def test_sglangs_rules_refuse_what_the_old_command_asked_on_a_cpu(tmp_path):
    """The check itself: the deterministic flag with SGLang's CPU backend (explicit, or its
    default there) is refused by the wheel's rule, as the server refused it (30 s, exit)."""
    base = ["-m", "sglang.launch_server", "--model-path", str(tmp_path), "--device", "cpu"]
    judged = _sglang_judges([[*base, "--enable-deterministic-inference"],
                             [*base, "--attention-backend", "torch_native",
                              "--enable-deterministic-inference"],
                             [*base, "--no-such-flag"]])
    errors = [result["error"] for result in judged["results"]]
    assert all(errors), errors
    assert "'intel_amx'" in errors[0] and "'torch_native'" in errors[1]
    assert "no-such-flag" in errors[2]


async def test_pool_sglang_kv_share_dir_reaches_every_cells_command(tmp_path):
    """`pool.sglang_kv_share_dir` gives every SGLang cell the same shared-storage flags; a
    built-in pool refuses the key by name."""
    pool = CellPoolConfig(engine="sglang", num_cells=2, sglang_kv_share_dir=str(tmp_path))
    commands = [cell_launcher(pool, cell_id, 3).command(tmp_path, 30000)
                for cell_id in range(2)]
    assert [command[-len(kv_share_args(tmp_path)):] for command in commands] == [
        kv_share_args(tmp_path)] * 2
    assert "--enable-hierarchical-cache" not in cell_launcher(
        CellPoolConfig(engine="sglang"), 0, 3).command(tmp_path, 30000)
    with pytest.raises(ValueError, match=r"pool\.sglang_kv_share_dir=.* SGLang cells only"):
        CellPoolConfig(sglang_kv_share_dir=str(tmp_path))
    with pytest.raises(ValueError, match="only SGLang servers can"):
        sharing_kv(BuiltinLauncher(), tmp_path)
