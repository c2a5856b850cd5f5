"""The launcher each rollout cell gets (`undertow/cells/pool.py`, `backends.host_launcher`),
as pure functions: the engine kind `pool.engine` names, an SGLang cell's command line, its
GPUs (`CUDA_VISIBLE_DEVICES`, cell after cell), tensor parallelism and memory fraction,
and SGLang cells that do not fit in a node's GPUs refused by name."""

from pathlib import Path

import pytest

from undertow.cells.backends import check_ray_engine_gpus, host_launcher
from undertow.cells.config import CellPoolConfig
from undertow.cells.pool import cell_gpu_ids, cell_launcher, check_engine_gpus
from undertow.gateway.engines.launch import BuiltinLauncher, SGLangLauncher


def _flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_a_builtin_cell_runs_the_builtin_engine_on_its_threads():
    launcher = cell_launcher(CellPoolConfig(threads_per_cell=3), 1, 5)
    assert isinstance(launcher, BuiltinLauncher)
    assert (launcher.weight_version, dict(launcher.overrides)) == ("5", {"num_threads": 3})


def test_each_sglang_cell_sees_only_its_own_gpus(tmp_path):
    pool = CellPoolConfig(engine="sglang", num_cells=3, tp_size=2, processes_per_cell=2,
                          mem_fraction_static=0.75, sglang_python="/opt/sglang/bin/python")
    launchers = [cell_launcher(pool, cell_id, 4) for cell_id in range(3)]
    assert all(isinstance(launcher, SGLangLauncher) for launcher in launchers)
    visible = [launcher.environment()["CUDA_VISIBLE_DEVICES"] for launcher in launchers]
    assert visible == ["0,1", "2,3", "4,5"]
    for launcher in launchers:
        command = launcher.command(tmp_path, 30001)
        assert command[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
        assert _flag(command, "--model-path") == str(tmp_path)
        assert _flag(command, "--tp-size") == "2"
        assert _flag(command, "--mem-fraction-static") == "0.75"
        assert _flag(command, "--base-gpu-id") == "0"
        assert _flag(command, "--weight-version") == "4"
        assert _flag(command, "--port") == "30001"
    assert cell_gpu_ids(2, 4) == (8, 9, 10, 11)


def test_an_sglang_cell_without_a_python_uses_this_one_and_sglangs_memory_choice(tmp_path):
    launcher = cell_launcher(CellPoolConfig(engine="sglang"), 0, 0)
    command = launcher.command(tmp_path, 30002)
    assert Path(command[0]) == SGLangLauncher().python
    assert "--mem-fraction-static" not in command and "--tp-size" not in command
    assert launcher.environment()["CUDA_VISIBLE_DEVICES"] == "0"


def test_sglang_cells_that_do_not_fit_in_the_node_are_refused_by_name():
    pool = CellPoolConfig(engine="sglang", num_cells=3, tp_size=2, processes_per_cell=2)
    check_engine_gpus(pool, 6)
    with pytest.raises(ValueError, match=r"pool\.num_cells=3 .* pool\.tp_size=2 .* need 6 "
                                         r"GPUs, but this node has 4"):
        check_engine_gpus(pool, 4)
    check_engine_gpus(CellPoolConfig(num_cells=8), 0)  # built-in cells take no GPU


def test_an_engine_host_gives_sglang_the_gpus_ray_assigned(tmp_path):
    pool = CellPoolConfig(engine="sglang", backend="ray", tp_size=2)
    launcher = host_launcher(cell_launcher(pool, 0, 1), "10.0.0.7", [6, 7])
    assert launcher.environment()["CUDA_VISIBLE_DEVICES"] == "6,7"
    command = launcher.command(tmp_path, 30003)
    assert command[-2:] == ["--host", "0.0.0.0"]  # the last --host wins
    assert _flag(command, "--tp-size") == "2"
    with pytest.raises(ValueError, match=r"GPUs \[6\] from Ray, but pool\.tp_size=2"):
        host_launcher(cell_launcher(pool, 0, 1), "10.0.0.7", [6])
    builtin = host_launcher(cell_launcher(CellPoolConfig(backend="ray"), 0, 1), "127.0.0.1", [])
    assert "0.0.0.0" not in builtin.command(tmp_path, None)


def test_sglang_engines_larger_than_every_ray_node_are_refused_by_name():
    check_ray_engine_gpus(4, [2.0, 4.0])
    with pytest.raises(ValueError, match=r"pool\.tp_size=4 .* largest node of the Ray "
                                         r"cluster has 2; lower pool\.tp_size"):
        check_ray_engine_gpus(4, [2.0, 0.0])
    with pytest.raises(ValueError, match=r"pool\.tp_size=1 .* has 0"):
        check_ray_engine_gpus(1, [])
