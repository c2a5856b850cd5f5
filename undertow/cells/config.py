"""The `pool` section of a run config: how `undertow train` splits this machine into cells.

Without a `pool` section `undertow train` runs one cell that never moves (one engine, the
learner training in its own process: `undertow/cells/one_cell.py`). With one, the machine
is `num_cells` cells of `threads_per_cell` CPU threads each; a cell either serves one
built-in engine (rollout) or runs one member of the elastic learner (training), and
`policy` moves cells between the two (`policy.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from undertow.cells.policy import POLICIES

BACKENDS = ("local", "ray")
CELL_ENGINES = ("builtin", "sglang")


@dataclass(frozen=True)
class CellPoolConfig:
    """One cell pool on this machine.

    `num_session_slots` is a cell's C_e in the waterlevel rule: how many sessions its
    engine is counted to hold at once. `num_training_cells` is read by `split` only;
    `max_staleness` by `split` and `elastic` (None: the policy's default, 1 for split
    and 0, synchronous, for elastic; colocate is always synchronous). `timeout_s`
    bounds how long a training member waits for a step to open or for its next
    micro-batch (the rollout tail of the step comes before that) and the step's final
    sum.
    `resident_members` keeps a cell's learner member process (and its copy of the model)
    alive while the cell serves, so that moving to training skips a process start and
    a model load; off, the member ends when its cell leaves training.
    `processes_per_cell` > 1 makes a training cell's learner member that many processes
    sharding one copy of the model (FSDP2 over gloo, one mesh per cell, each process
    with `threads_per_cell` threads; `elastic/sharded_cell.py`); 1 is one process holding a
    whole replica. A sharded cell scores no KL reference: loss.kl_coef must be 0.

    `backend` says where the cells run: `local`, this machine's processes; `ray`, a Ray
    cluster (`undertow/cells/backends.py`): members as Ray actors in a placement group per
    cell, engines started by an actor on the cell's node. `ray_address` is the cluster to
    join ("" starts a Ray instance on this machine for the run; "auto" or "HOST:PORT",
    as `ray.init(address=...)` takes it). `gateway_host` is the address the gateway binds
    ("0.0.0.0" for every interface) and `advertise_host` the one handed to rollouts and
    to the other nodes ("": the bound address, or this node's IP as Ray sees it when
    bound to every interface).

    Devices: the members train on `learner.device` with the learner section's dtype,
    mixed precision, activation checkpointing and attention, as the plain run does
    (`undertow/cells/elastic/devices.py`). On the local backend with CUDA, cell c's process r
    takes GPU (c * processes_per_cell + r) modulo the GPUs visible, block by block (so
    cells may share a GPU; the processes of one sharded cell never do, and a sharded
    cell's mesh is NCCL's). `gpus_per_member` is what each member actor asks Ray for
    (`ray` backend only): None is 1 when the members train on CUDA and 0 on the CPU; a
    fraction lets members share a GPU.

    Engines: `engine` is what a rollout cell serves: `builtin`, Undertow's own engine on
    `threads_per_cell` CPU threads; `sglang`, an SGLang server on the cell's `tp_size`
    GPUs (tensor parallel) taking `mem_fraction_static` of their memory (None: SGLang's
    choice), run by `sglang_python` ("": this python); `sglang_kv_share_dir`, a directory
    every cell's node sees ("": none), makes the engines share KV through HiCache's file
    storage, so that a migrated session loads its prefix there instead of prefilling it
    (`SGLangLauncher.kv_share_dir`). On the local backend cell c's
    engine sees GPUs c * tp_size .. (c + 1) * tp_size - 1 only, the GPUs its learner
    member trains on, so `processes_per_cell` must equal `tp_size`; on Ray its engine
    host asks for `tp_size` GPUs and the engine sees the ones Ray assigns. Either way the
    engine stops, and its GPUs are free, before the cell's learner member starts (and
    `resident_members`, which would keep the member on those GPUs, is refused).
    """

    policy: str = "elastic"
    num_cells: int = 3
    num_training_cells: int = 1
    max_staleness: int | None = None
    threads_per_cell: int = 1
    num_session_slots: int = 2
    timeout_s: float = 3600.0
    resident_members: bool = False
    processes_per_cell: int = 1
    backend: str = "local"
    ray_address: str = ""
    gateway_host: str = "127.0.0.1"
    advertise_host: str = ""
    gpus_per_member: float | None = None
    engine: str = "builtin"
    tp_size: int = 1
    mem_fraction_static: float | None = None
    sglang_python: str = ""
    sglang_kv_share_dir: str = ""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"pool.backend must be one of {list(BACKENDS)}, "
                             f"got {self.backend!r}")
        if self.ray_address and self.backend != "ray":
            raise ValueError(f"pool.ray_address={self.ray_address!r} is set, but "
                             f"pool.backend={self.backend!r}; set pool.backend=ray")
        if self.backend == "ray" and self.processes_per_cell != 1:
            raise ValueError(f"pool.processes_per_cell={self.processes_per_cell}: sharded "
                             "cells run on the local backend only; set pool.backend=local "
                             "or pool.processes_per_cell=1")
        if self.policy not in POLICIES:
            raise ValueError(f"pool.policy must be one of {sorted(POLICIES)}, "
                             f"got {self.policy!r}")
        for name in ("num_cells", "threads_per_cell", "num_session_slots",
                     "processes_per_cell"):
            if getattr(self, name) < 1:
                raise ValueError(f"pool.{name} must be >= 1, got {getattr(self, name)}")
        if self.policy == "split" and not 1 <= self.num_training_cells < self.num_cells:
            raise ValueError(f"pool.num_training_cells={self.num_training_cells} must leave "
                             f"at least one of pool.num_cells={self.num_cells} for rollout")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"pool.max_staleness must be >= 0, got {self.max_staleness}")
        if self.timeout_s <= 0:
            raise ValueError(f"pool.timeout_s must be positive, got {self.timeout_s}")
        self._check_gpus()
        self._check_engine()

    def _check_gpus(self) -> None:
        gpus = self.gpus_per_member
        if gpus is None:
            return
        if isinstance(gpus, bool) or not isinstance(gpus, int | float) or gpus < 0:
            raise ValueError(f"pool.gpus_per_member must be a number >= 0 (or null: 1 on "
                             f"CUDA, 0 on the CPU), got {gpus!r}")
        if self.backend != "ray":
            raise ValueError(f"pool.gpus_per_member={gpus} is read by the ray backend only; "
                             "set pool.backend=ray or remove it (the local backend gives "
                             "each member process a GPU of its own)")

    def _check_engine(self) -> None:
        if self.engine not in CELL_ENGINES:
            raise ValueError(f"pool.engine must be one of {list(CELL_ENGINES)}, "
                             f"got {self.engine!r}")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) \
                or self.tp_size < 1:
            raise ValueError(f"pool.tp_size must be an integer >= 1, got {self.tp_size!r}")
        fraction = self.mem_fraction_static
        if fraction is not None and not (isinstance(fraction, int | float)
                                         and 0 < fraction < 1):
            raise ValueError(f"pool.mem_fraction_static must be in (0, 1) (or null: "
                             f"SGLang's choice), got {fraction!r}")
        if self.engine == "builtin":
            for name, default in (("tp_size", 1), ("mem_fraction_static", None),
                                  ("sglang_python", ""), ("sglang_kv_share_dir", "")):
                if getattr(self, name) != default:
                    raise ValueError(f"pool.{name}={getattr(self, name)!r} is read by SGLang "
                                     "cells only; set pool.engine=sglang or remove it")
            return
        if self.resident_members:
            raise ValueError("pool.resident_members=true keeps a learner member's model on "
                             "the cell's GPUs while its SGLang engine serves there; set "
                             "pool.resident_members=false with pool.engine=sglang")
        if self.backend == "local" and self.processes_per_cell != self.tp_size:
            raise ValueError(f"pool.processes_per_cell={self.processes_per_cell} must equal "
                             f"pool.tp_size={self.tp_size} with pool.engine=sglang on the "
                             "local backend: a cell's learner member trains on the cell's "
                             "GPUs, one process per GPU")

    def num_engine_gpus(self) -> int:
        """GPUs the cells' engines take on one node when every cell serves (0: CPU)."""
        return self.num_cells * self.tp_size if self.engine == "sglang" else 0

    def policy_spec(self) -> dict:
        """The spec `policy.make_policy` takes."""
        spec: dict = {"name": self.policy}
        if self.policy == "split":
            spec["num_training_cells"] = self.num_training_cells
        if self.policy in ("split", "elastic") and self.max_staleness is not None:
            spec["max_staleness"] = self.max_staleness
        return spec
