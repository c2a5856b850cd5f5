"""The local backend of a pool run (`undertow/cells/backends.py`) starts a training cell's
learner member as `pool.processes_per_cell` processes (a sharded cell,
`undertow/cells/elastic/sharded_cell.py`; its step is tested in
tests/cells/elastic/test_local.py),
and the run config refuses what no backend runs."""

import pytest

from undertow.cells.backends import LocalBackend
from undertow.cells.config import CellPoolConfig
from undertow.cells.errors import CellPoolError


def test_the_local_backend_shards_cells_as_the_run_config_asks(tiny_model_dir):
    address = ("127.0.0.1", 1)   # nothing is started: members begin when a cell trains
    sharded = LocalBackend(CellPoolConfig(processes_per_cell=2)).members(
        address, tiny_model_dir, timeout_s=5.0, num_threads=1)
    assert sharded.processes_per_cell == 2 and sharded.member_options == {"num_threads": 1}
    assert LocalBackend(CellPoolConfig()).members(address, tiny_model_dir).processes_per_cell == 1
    with pytest.raises(CellPoolError, match="kl_coef"):
        LocalBackend(CellPoolConfig(processes_per_cell=2)).members(
            address, tiny_model_dir, reference_dir=str(tiny_model_dir))
    with pytest.raises(ValueError, match=r"pool\.processes_per_cell"):
        CellPoolConfig(processes_per_cell=2, backend="ray")


def test_ray_members_ask_for_the_gpus_their_device_needs():
    from undertow.cells.backends import ray_gpus_per_member

    assert ray_gpus_per_member(None, "cuda") == 1.0
    assert ray_gpus_per_member(None, "cpu") == 0.0
    assert ray_gpus_per_member(0.5, "cuda") == 0.5          # members share a GPU
    assert ray_gpus_per_member(2, "cpu") == 2.0
    with pytest.raises(ValueError, match=r"pool\.gpus_per_member=0 .* learner\.device"):
        ray_gpus_per_member(0, "cuda")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA is here")
def test_cuda_without_cuda_is_refused_before_ray_starts(tmp_path):
    import sys

    from undertow.cells.backends import pool_backend
    from undertow.learner.config import TrainConfig

    ray_loaded = "ray" in sys.modules
    pool = CellPoolConfig(backend="ray")
    with pytest.raises(ValueError, match=r"learner\.device is 'cuda'"), \
            pool_backend(pool, tmp_path, TrainConfig(device="cuda")):
        pytest.fail("the backend started")
    assert ("ray" in sys.modules) == ray_loaded   # nothing of Ray was even imported
    with pool_backend(CellPoolConfig(), tmp_path, TrainConfig(device="auto")) as backend:
        assert backend.pool.backend == "local"
