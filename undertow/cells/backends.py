"""Where a pool run's cells run: this machine's processes (`local`) or a Ray cluster (`ray`);
`pool_backend` picks the one `pool.backend` names (docs/cluster.md, "Backends").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import shutil
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from undertow.cells.config import CellPoolConfig
from undertow.cells.elastic.ray_members import RayMembers
from undertow.cells.pool import GatewayEngineSlots, cell_launcher, check_engine_gpus
from undertow.gateway.engines.launch import LAUNCHERS, Launcher, RunningEngine

if TYPE_CHECKING:
    from undertow.learner.config import TrainConfig
    from undertow.learner.gateway_link import GatewayLink

PLACEMENTS_FILE = "ray_placements.jsonl"
ANY_ADDRESS = ("0.0.0.0", "::")
PROBE_TIMEOUT_S = 10.0


class LocalBackend:
    """The cells as processes of this machine (`elastic.local.ProcessMembers`, local engines)."""

    def __init__(self, pool: CellPoolConfig):
        self.pool = pool
        self.gateway_host = pool.gateway_host
        self.advertise_host = pool.advertise_host or _loopback_or(pool.gateway_host)

    def members(self, address: tuple[str, int], model_dir: Path, **options: Any) -> Any:
        from undertow.cells.elastic.local import ProcessMembers

        return ProcessMembers(address, model_dir,
                              processes_per_cell=self.pool.processes_per_cell, **options)

    def engine_slots(self, loop: asyncio.AbstractEventLoop, admin: GatewayLink, model_dir: Path,
                     log_dir: Path, threads_per_cell: int, push_mode: str,
                     weight_version: int = 0) -> GatewayEngineSlots:
        return GatewayEngineSlots(loop, admin, model_dir, log_dir, threads_per_cell, push_mode,
                                  launchers=functools.partial(cell_launcher, self.pool),
                                  warm_start=not LAUNCHERS[self.pool.engine].uses_gpus,
                                  weight_version=weight_version)

    def advertised_url(self, url: str) -> str:
        """The gateway's URL as other processes and nodes should use it."""
        scheme, rest = url.split("://", 1)
        return f"{scheme}://{_url_host(self.advertise_host)}:{rest.rsplit(':', 1)[1]}"


class RayBackend(LocalBackend):
    """The cells on the connected Ray cluster (see the module docstring)."""

    def __init__(self, pool: CellPoolConfig, run_dir: Path):
        import ray

        super().__init__(pool)
        if not pool.advertise_host and pool.gateway_host in ANY_ADDRESS:
            self.advertise_host = ray.util.get_node_ip_address()
        if LAUNCHERS[pool.engine].uses_gpus:
            check_ray_engine_gpus(pool.tp_size, [node["Resources"].get("GPU", 0.0)
                                                 for node in ray.nodes() if node.get("Alive")])
        self.placements = PlacementLog(Path(run_dir) / PLACEMENTS_FILE)
        self.gateway_url = ""

    def members(self, address: tuple[str, int], model_dir: Path, **options: Any) -> Any:
        import ray
        import torch

        from undertow.cells.elastic.devices import check_cell_gpus, member_device_name
        from undertow.cells.elastic.ray_members import RayCell, pinned_resources

        learner = options.get("learner")
        device = "cpu" if learner is None else member_device_name(
            learner.device, torch.cuda.is_available())
        gpus = ray_gpus_per_member(self.pool.gpus_per_member, device)
        check_cell_gpus(gpus, [node["Resources"].get("GPU", 0.0) for node in ray.nodes()
                               if node.get("Alive")])
        cells = {cell_id: RayCell(num_cpus_per_member=self.pool.threads_per_cell,
                                  num_gpus_per_member=gpus,
                                  resources_per_member=pinned_resources(cell_id))
                 for cell_id in range(self.pool.num_cells)}
        return RecordedRayMembers(self.placements, (self.advertise_host, address[1]), model_dir,
                                  cells, **options)

    def engine_slots(self, loop: asyncio.AbstractEventLoop, admin: GatewayLink, model_dir: Path,
                     log_dir: Path, threads_per_cell: int, push_mode: str,
                     weight_version: int = 0) -> GatewayEngineSlots:
        return RayEngineSlots(self.placements, self.gateway_url,
                              self.pool.num_engine_gpus() // self.pool.num_cells,
                              loop, admin, model_dir, log_dir, threads_per_cell, push_mode,
                              launchers=functools.partial(cell_launcher, self.pool),
                              warm_start=not LAUNCHERS[self.pool.engine].uses_gpus,
                              weight_version=weight_version)

    def advertised_url(self, url: str) -> str:
        self.gateway_url = super().advertised_url(url)
        return self.gateway_url


def ray_gpus_per_member(gpus_per_member: float | None, member_device: str) -> float:
    """What each member actor asks Ray for: `pool.gpus_per_member`, or 1 when the
    members train on CUDA (`member_device`, "auto" already resolved) and 0 on the CPU;
    ValueError for CUDA members with 0 GPUs (Ray would hide every GPU from them)."""
    if gpus_per_member is None:
        return 1.0 if member_device == "cuda" else 0.0
    if member_device == "cuda" and gpus_per_member <= 0:
        raise ValueError("pool.gpus_per_member=0 but learner.device is 'cuda': Ray hides "
                         "the GPUs from an actor that asks for none; set pool.gpus_per_member "
                         "> 0 (or remove it) or learner.device: cpu")
    return float(gpus_per_member)


def check_ray_engine_gpus(tp_size: int, node_gpus: list[float]) -> None:
    """Refuses SGLang engines of `tp_size` GPUs that no node of the cluster (its nodes'
    GPU counts, `node_gpus`) could hold: an engine's GPUs are on one node."""
    largest = max(node_gpus, default=0.0)
    if tp_size > largest:
        raise ValueError(f"pool.tp_size={tp_size} GPUs per SGLang engine, but the largest "
                         f"node of the Ray cluster has {largest:g}; lower pool.tp_size or "
                         "add GPUs (ray start --num-gpus)")


def check_devices(pool: CellPoolConfig, learner: TrainConfig | None) -> None:
    """Refuses a `learner.device` the pool cannot honour on this node, before anything
    starts (`devices.member_learner`, as the member slots check it again)."""
    from undertow.cells.elastic.devices import member_learner

    member_learner({"learner": learner}, pool.processes_per_cell)


@contextlib.contextmanager
def pool_backend(pool: CellPoolConfig, run_dir: Path,
                 learner: TrainConfig | None = None) -> Iterator[LocalBackend]:
    """The backend `pool.backend` names, ready for the block (on Ray: connected, or a
    one-machine Ray started, and disconnected or stopped at the end). With the run's
    `learner` section, its device is checked first (`check_devices`)."""
    if learner is not None:
        check_devices(pool, learner)
    if pool.backend == "local" and LAUNCHERS[pool.engine].uses_gpus:
        import torch

        check_engine_gpus(pool, torch.cuda.device_count())
    if pool.backend == "local":
        yield LocalBackend(pool)
        return
    from undertow.cells.elastic.ray_members import connect

    # A one-machine Ray's files: under /tmp, as its socket paths must stay short (about
    # 100 bytes); a cluster keeps its own.
    temp_dir = "" if pool.ray_address else tempfile.mkdtemp(prefix="undertow-ray-")
    try:
        with connect(pool.ray_address, temp_dir, pool.num_cells * pool.threads_per_cell):
            yield RayBackend(pool, run_dir)
    finally:
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


class PlacementLog:
    """`ray_placements.jsonl`: where each member and engine of the run ran."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


def read_placements(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `ray_placements.jsonl` in `run_dir` (empty if none)."""
    path = Path(run_dir) / PLACEMENTS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


class RecordedRayMembers(RayMembers):
    """`RayMembers` that write where each cell's members ran, when the cell stops (its
    actors are up by then) or at the end of the run."""

    def __init__(self, placements_log: PlacementLog, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.placements_log = placements_log

    @property
    def running(self) -> dict[int, Any]:
        """The started cells (what `cells.ResidentMembers` looks up)."""
        return self.groups

    def stop(self, cell_id: int) -> None:
        self._record(cell_id, self.timeout_s)
        super().stop(cell_id)

    def close(self) -> None:
        """Records what answers within a few seconds, then ends every group."""
        for cell_id in list(self.groups):
            self._record(cell_id, PROBE_TIMEOUT_S)
        super().close()

    def _record(self, cell_id: int, timeout_s: float) -> None:
        """Writes where the cell's members run, for those that answer within `timeout_s`
        (a member that failed is written with its error; `stop` raises it)."""
        import ray
        from ray.exceptions import RayError

        refs = self.groups[cell_id].placements
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                placement = ray.get(ref)
            except RayError as error:
                placement = {"error": str(error)}
            self.placements_log.write({"kind": "member", "cell_id": cell_id, **placement})


class EngineHost:
    """The body of a cell's engine actor (wrapped with `ray.remote` by `RayEngineSlots`):
    starts and stops the cell's engine processes on its node.

    Invariants: `engines` holds every engine process this host started and has not
    stopped, by URL; `stop_all` leaves none running.
    """

    def __init__(self):
        self.engines: dict[str, RunningEngine] = {}

    def start(self, model_dir: str, launcher: Launcher, log_path: str) -> str:
        """Starts `launcher`'s engine on `model_dir`; returns its URL as the other nodes
        reach it (this node's IP)."""
        import ray

        from undertow.gateway.engines.launch import start_engine

        node_ip = ray.util.get_node_ip_address()
        launcher = host_launcher(launcher, node_ip, ray.get_gpu_ids())
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        engine = asyncio.run(start_engine(launcher, model_dir, log_path=Path(log_path)))
        url = f"http://{_url_host(node_ip)}:{engine.url.rsplit(':', 1)[1]}"
        self.engines[url] = engine
        return url

    def stop(self, url: str) -> None:
        engine = self.engines.pop(url, None)
        if engine is not None:
            asyncio.run(engine.stop())

    def stop_all(self) -> None:
        for url in list(self.engines):
            self.stop(url)

    def placement(self, gateway_url: str) -> dict[str, Any]:
        """This host's node and process, and whether the gateway answers from here."""
        import os

        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "node_ip": ray.util.get_node_ip_address(),
                "gateway_reachable": _reachable(gateway_url) if gateway_url else None}


def host_launcher(launcher: Launcher, node_ip: str, gpu_ids: list) -> Launcher:
    """`launcher` as an engine host on `node_ip` runs it: bound to every interface unless
    the node's address is loopback (the last --host wins; readiness is probed locally),
    and an SGLang engine on the GPUs Ray assigned the host (`gpu_ids`); the built-in
    engine runs with the host's python (`Launcher.for_host`)."""
    return launcher.for_host(node_ip, gpu_ids)


@dataclass
class RemoteEngine(RunningEngine):
    """An engine that an `EngineHost` actor runs on another process (maybe node);
    `process` is None here, and `stop` asks the host. `owns_host`: the host was started
    for this engine alone (it holds the engine's GPUs at Ray) and ends with it."""

    host: Any = None
    owns_host: bool = False

    async def stop(self) -> None:
        await self.host.stop.remote(self.url)
        if self.owns_host:
            import ray

            ray.kill(self.host, no_restart=True)


class RayEngineSlots(GatewayEngineSlots):
    """`GatewayEngineSlots` whose engines run on their cells' nodes, each started by
    one long-lived `EngineHost` actor per cell (created on the cell's first start), or,
    for engines of `num_gpus_per_engine` > 0 GPUs, by an actor of their own that holds
    those GPUs at Ray and ends when the engine stops."""

    def __init__(self, placements: PlacementLog, gateway_url: str, num_gpus_per_engine: int,
                 *args: Any, **kwargs: Any):
        import ray

        super().__init__(*args, **kwargs)
        self.placements, self.gateway_url = placements, gateway_url
        self.num_gpus_per_engine = num_gpus_per_engine
        self.host_class = ray.remote(num_cpus=0, max_restarts=0)(EngineHost)
        self.hosts: dict[int, Any] = {}

    async def _start(self, cell_id: int) -> RunningEngine:
        self.num_started += 1
        model_dir, version = self.weights
        log_path = self.log_dir / f"cell-{cell_id}-{self.num_started}.log"
        launcher = self.launchers(cell_id, version)
        owns_host = self.num_gpus_per_engine > 0
        host = await (self._gpu_host(cell_id) if owns_host else self._host(cell_id))
        try:
            url = await host.start.remote(str(model_dir), launcher, str(log_path))
        except BaseException:
            if owns_host:
                import ray

                ray.kill(host, no_restart=True)
            raise
        return RemoteEngine(launcher=launcher, url=url, log_path=log_path, host=host,
                            owns_host=owns_host,
                            process=None)  # pyright: ignore[reportArgumentType]  # the host runs it

    async def _host(self, cell_id: int) -> Any:
        from undertow.cells.elastic.ray_members import pinned_resources

        if cell_id not in self.hosts:
            host = self.host_class.options(resources=pinned_resources(cell_id)).remote()
            self.hosts[cell_id] = host
            await self._record(cell_id, host)
        return self.hosts[cell_id]

    async def _gpu_host(self, cell_id: int) -> Any:
        """A new host of the cell's engine GPUs, on the cell's node."""
        from undertow.cells.elastic.ray_members import pinned_resources

        host = self.host_class.options(resources=pinned_resources(cell_id),
                                       num_gpus=self.num_gpus_per_engine).remote()
        await self._record(cell_id, host)
        return host

    async def _record(self, cell_id: int, host: Any) -> None:
        placement = await host.placement.remote(self.gateway_url)
        self.placements.write({"kind": "engine", "cell_id": cell_id, **placement})
        if placement["gateway_reachable"] is False:
            print(f"undertow train: warning: the gateway {self.gateway_url} does not "
                  f"answer from node {placement['node_ip']} (cell {cell_id}); set "
                  "pool.gateway_host=0.0.0.0 and pool.advertise_host", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        """Stops every engine, then ends the engine hosts."""
        import ray
        from ray.exceptions import RayError

        try:
            super().close()
        finally:
            hosts, self.hosts = self.hosts, {}
            with contextlib.suppress(RayError):
                ray.get([host.stop_all.remote() for host in hosts.values()],
                        timeout=PROBE_TIMEOUT_S * 3)
            for host in hosts.values():
                ray.kill(host, no_restart=True)


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=PROBE_TIMEOUT_S) as reply:
            return reply.status == 200
    except OSError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _loopback_or(host: str) -> str:
    return "127.0.0.1" if host in ANY_ADDRESS else host
