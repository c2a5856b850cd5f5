"""The local backend of a pool run (`undertow/pool_backends.py`) starts a training cell's
learner member as `pool.processes_per_cell` processes (a sharded cell,
`learner/elastic/sharded_cell.py`; its step is tested in tests/learner/elastic/test_local.py),
and the run config refuses what no backend runs."""

import pytest

from undertow.learner.pool.config import CellPoolConfig
from undertow.learner.pool.errors import CellPoolError
from undertow.pool_backends import LocalBackend


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
