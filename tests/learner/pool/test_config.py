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
    ({"gpus_per_member": 1}, "read by the ray backend only"),
    ({"backend": "ray", "gpus_per_member": -1}, "gpus_per_member must be a number >= 0"),
    ({"backend": "ray", "gpus_per_member": True}, "gpus_per_member must be a number >= 0"),
])
def test_a_bad_backend_setting_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        CellPoolConfig(**fields)


def test_gpus_per_member_is_a_ray_setting_that_may_be_a_fraction():
    assert CellPoolConfig().gpus_per_member is None
    assert CellPoolConfig(backend="ray", gpus_per_member=0.5).gpus_per_member == 0.5
