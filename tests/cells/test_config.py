"""The pool section's backend fields: `local` or `ray`, and the Ray-only settings refused
with the local backend, each error naming the field and what to set."""

import pytest

from undertow.cells.config import CellPoolConfig


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


def test_cells_serve_the_builtin_engine_unless_sglang_is_chosen():
    assert (CellPoolConfig().engine, CellPoolConfig().num_engine_gpus()) == ("builtin", 0)
    config = CellPoolConfig(engine="sglang", num_cells=4, tp_size=2, processes_per_cell=2,
                            mem_fraction_static=0.8)
    assert (config.tp_size, config.mem_fraction_static) == (2, 0.8)
    assert config.num_engine_gpus() == 8
    ray = CellPoolConfig(engine="sglang", backend="ray", tp_size=4, sglang_python="/sg/python")
    assert (ray.processes_per_cell, ray.num_engine_gpus()) == (1, 12)


@pytest.mark.parametrize(("fields", "message"), [
    ({"engine": "vllm"}, r"pool\.engine must be one of \['builtin', 'sglang'\]"),
    ({"engine": "sglang", "tp_size": 0}, r"pool\.tp_size must be an integer >= 1"),
    ({"engine": "sglang", "tp_size": 1.5}, r"pool\.tp_size must be an integer >= 1"),
    ({"engine": "sglang", "mem_fraction_static": 1.0}, r"pool\.mem_fraction_static must be in"),
    ({"engine": "sglang", "mem_fraction_static": 0}, r"pool\.mem_fraction_static must be in"),
    ({"tp_size": 2}, r"pool\.tp_size=2 is read by SGLang cells only"),
    ({"mem_fraction_static": 0.5}, r"pool\.mem_fraction_static=0\.5 is read by SGLang"),
    ({"sglang_python": "/x"}, r"pool\.sglang_python='/x' is read by SGLang"),
    ({"engine": "sglang", "tp_size": 2}, r"pool\.processes_per_cell=1 must equal pool\.tp_size=2"),
    ({"engine": "sglang", "resident_members": True}, r"pool\.resident_members=true keeps"),
])
def test_a_bad_engine_setting_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        CellPoolConfig(**fields)
