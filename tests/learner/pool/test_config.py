"""The pool section's backend fields: `local` or `ray`, and the Ray-only settings refused
with the local backend, each error naming the field and what to set."""

import pytest

from undertow.learner.pool.config import CellPoolConfig


def test_the_backend_defaults_to_local_and_takes_ray():
    assert CellPoolConfig().backend == "local"
    config = CellPoolConfig(backend="ray", ray_address="auto", gateway_host="0.0.0.0")
    assert (config.backend, config.ray_address, config.gateway_host) == ("ray", "auto", "0.0.0.0")


@pytest.mark.parametrize(("fields", "message"), [
    ({"backend": "slurm"}, "pool.backend must be one of"),
    ({"ray_address": "auto"}, "set pool.backend=ray"),
    ({"backend": "ray", "processes_per_cell": 2}, "sharded cells run on the local backend"),
])
def test_a_bad_backend_setting_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        CellPoolConfig(**fields)
