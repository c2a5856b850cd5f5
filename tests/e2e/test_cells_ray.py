"""SGLang cells on Ray (`pool_backends.RayEngineSlots`) on a local Ray instance that
declares two fake GPUs: a cell's engine host asks Ray for `pool.tp_size` GPUs, the engine
(the SGLang stand-in of `test_cells.py`, so the wiring, not SGLang) sees the GPUs Ray
assigned, and draining the cell hands those GPUs back to Ray for its learner member."""

import importlib.util
import tempfile
import time

import pytest

from tests.e2e.test_cells import _launches, _standin_python
from undertow.cells.config import CellPoolConfig
from undertow.cells.pool import engineless_gateway
from undertow.learner.gateway_link import GatewayLink
from undertow.run.rollout_source import background_loop

# Ray is imported by the test, not here: it decides at import time whether to bind loopback.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                       reason="ray is not installed (pip install -e '.[cluster]')"),
]

RELEASE_TIMEOUT_S = 60.0


def _free_gpus(ray) -> float:
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while ray.available_resources().get("GPU", 0.0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("GPU", 0.0)


def test_an_sglang_cells_engine_holds_its_ray_gpus_until_drained(tiny_model_dir, tmp_path):
    from undertow.cells.backends import RayBackend
    from undertow.cells.elastic.ray_members import cell_resource, local_cluster

    python, record = _standin_python(tmp_path)
    pool = CellPoolConfig(engine="sglang", backend="ray", num_cells=1, tp_size=2,
                          mem_fraction_static=0.5, sglang_python=str(python))
    # Ray's socket paths must stay short (about 100 bytes): its files under /tmp.
    with tempfile.TemporaryDirectory(prefix="undertow-ray-") as ray_dir, \
            local_cluster(ray_dir, num_cpus=2, num_gpus=2, resources={cell_resource(0): 1}), \
            background_loop() as loop, \
            engineless_gateway(loop, tiny_model_dir, tmp_path / "store") as gateway:
        import ray

        backend = RayBackend(pool, tmp_path / "run")
        backend.advertised_url(gateway.url)
        admin = GatewayLink(gateway.url, gateway.admin_token)
        slots = backend.engine_slots(loop, admin, tiny_model_dir, tmp_path / "engines", 1,
                                     "drain")
        try:
            slots.start_all([0])
            (launch,) = _launches(record)
            assert sorted(launch["cuda_visible_devices"].split(",")) == ["0", "1"]
            assert (launch["tp_size"], launch["mem_fraction_static"]) == (2, 0.5)
            assert ray.available_resources().get("GPU", 0.0) == 0  # the host holds both
            slots.push(tiny_model_dir, 1)
            assert [e["weight_version"] for e in admin.engines()] == ["1"]
            slots.drain(0)
            assert admin.engines() == []
            assert _free_gpus(ray) == 2  # the host ended with its engine
            slots.serve(0, 1)
            assert _launches(record)[-1]["weight_version"] == "1"
            assert ray.available_resources().get("GPU", 0.0) == 0
        finally:
            slots.close()
        assert _free_gpus(ray) == 2
