"""A sharded training cell (FSDP2 over its processes) as one member of the elastic step
(docs/cluster.md, "A sharded cell").
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]  # public in torch's docs; re-exported without __all__
from torch.distributed.tensor import DTensor, distribute_tensor

from undertow.cells.elastic.step import (
    CPU_LEARNER,
    END,
    OPEN,
    load_member_policies,
    reduce_buffer,
    reduce_to_coordinator,
    step_store,
    tensors_digest,
    use_scoring_options,
)
from undertow.learner.config import LossConfig, TrainConfig
from undertow.learner.losses import chunk_weights
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_micro_batch, merge_stats, sequence_keep_of
from undertow.learner.sharding import (
    full_parameters,
    mean_to_sum,
    round_pass,
    shard_policy,
    step_to,
)
from undertow.learner.wire import decode_step, get_blob

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class CellMember:
    """One process of a sharded cell. Every process of the cell constructs one (after
    `dist.init_process_group` for the cell) and calls `join(step)` for the same steps.

    Invariants: only the leader touches the coordinator's store; every process of the
    cell runs the same number of forward and backward passes in a step; the cell's
    gradient enters the step only if the roster closed with the cell on it.
    """

    def __init__(self, address: tuple[str, int] | None, name: str, model_dir: str,
                 mesh: DeviceMesh, backend: str = "gloo", timeout_s: float = 300.0,
                 learner: TrainConfig = CPU_LEARNER):
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.name, self.backend, self.timeout_s = name, backend, timeout_s
        self.store: TCPStore | None = None
        if self.rank == 0:
            if address is None:
                raise ValueError(f"cell {name}: its leader (rank 0) needs the coordinator's "
                                 "store address")
            self.store = TCPStore(address[0], address[1], is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        # The process's GPU is already current (`cell_main`), so no index here.
        self.policy, _, _ = load_member_policies(learner, model_dir, None, None)
        shard_policy(self.policy, mesh, learner.mixed_precision)
        self.device = _sharded(next(self.policy.model.parameters())).to_local().device

    def join(self, step: int) -> bool:
        """The cell's share of `step`; False if it came too late or the step aborted."""
        store = step_store(self.store, step) if self.store is not None else None
        # The leader's rank in the step is broadcast (0: refused); the others' is unused.
        rank_in_step = self._register(store) if store is not None else 0
        if not self._broadcast_json({"rank": rank_in_step})["rank"]:
            return False
        spec = self._broadcast_json(json.loads(store.get("spec")) if store else None)
        use_scoring_options(spec["scoring"], self.policy)
        self._load_weights(get_blob(store, "weights") if store else b"")
        digest = weights_digest_of(self.policy)
        report = self._train(store, LossConfig(**spec["loss"]))
        full = self._whole_gradient()
        world_size = self._broadcast_json(
            int(_wait_get(store, "world_size")) if store else None)
        if store is not None and world_size:
            report["weights_digest"] = digest
            store.set(f"report/{self.name}", json.dumps(report))
            reduce_to_coordinator(self.backend, store, rank_in_step, world_size,
                                   reduce_buffer(self.backend, full), self.timeout_s)
        self.policy.model.zero_grad(set_to_none=True)
        return world_size > 0

    def _register(self, store: PrefixStore) -> int:
        store.wait(["spec"])
        while True:
            current = store.get("membership").decode()
            if not current.startswith(OPEN):
                return 0
            names = [n for n in current[len(OPEN):].split(",") if n]
            wanted = OPEN + ",".join([*names, self.name])
            if store.compare_set("membership", current, wanted).decode() == wanted:
                return len(names) + 1

    def _train(self, store: PrefixStore | None, config: LossConfig) -> dict[str, Any]:
        """Rounds of one micro-batch per process until the leader draws the end."""
        chunks: dict[int, tuple] = {}
        claimed, stats, ended, seen = [], {}, False, set()
        while not ended:
            picks = self._draw_round(store, seen) if store is not None else None
            picks = self._broadcast_json(picks)
            ended = picks["ended"]
            for chunk_id in picks["new_chunks"]:
                data = get_blob(store, f"chunk/{chunk_id}") if store is not None else b""
                chunk = step_to(decode_step(self._broadcast_bytes(data)), self.device)
                sequence_keep_of(self.policy, chunk, config)   # every process: collectives
                chunks[chunk_id] = (chunk, chunk_weights(config, chunk))
            entries = picks["entries"]
            if not entries:
                continue
            micro_batches = [chunks[where["chunk"]][0].micro_batches[where["index"]]
                             for _ticket, where in entries]
            backward = functools.partial(self._backward, chunks, entries, config)
            merge_stats(stats, round_pass(self.policy, self.device, micro_batches, self.rank,
                                          backward))
            if self.rank < len(entries):
                claimed.append(entries[self.rank][0])
        mean_to_sum(self.policy, self.size)
        claims = self._gather_json({"claimed": claimed, "stats": stats})
        total: dict[str, float] = {}
        for part in claims:
            merge_stats(total, part["stats"])
        return {"name": self.name, "stats": total,
                "claimed": sorted(t for part in claims for t in part["claimed"])}

    def _backward(self, chunks: dict[int, tuple], entries: list, config: LossConfig
                  ) -> dict[str, float]:
        """The forward, loss and backward of this process's micro-batch of the round."""
        where = entries[self.rank][1]
        chunk, weights = chunks[where["chunk"]]
        return backward_micro_batch(self.policy, chunk, weights, where["index"], config)

    def _draw_round(self, store: PrefixStore, seen: set[int]) -> dict[str, Any]:
        """The leader draws up to one ticket per process; stops at the queue's end.
        `seen`: the chunks already handed to the cell (updated)."""
        entries, new_chunks, ended = [], [], False
        for _ in range(self.size):
            index = store.add("next", 1) - 1
            store.wait([f"mb/{index}"])
            entry = store.get(f"mb/{index}").decode()
            if entry == END:
                store.set(f"mb/{index + 1}", END)
                store.set("drained", self.name)
                ended = True
                break
            where = json.loads(entry)
            if where["chunk"] not in seen:
                seen.add(where["chunk"])
                new_chunks.append(where["chunk"])
            entries.append((index, where))
        return {"entries": entries, "new_chunks": new_chunks, "ended": ended}

    def _load_weights(self, data: bytes) -> None:
        """The step's start weights, from the leader, into this process's shards."""
        from safetensors.torch import load as load_tensors

        tensors = load_tensors(self._broadcast_bytes(data))
        with torch.no_grad():
            for name, parameter in self.policy.model.named_parameters():
                full = tensors[name].to(self.device, parameter.dtype)
                shard = _sharded(parameter)
                parameter.copy_(distribute_tensor(full, shard.device_mesh, shard.placements))

    def _whole_gradient(self) -> torch.Tensor:
        """(P,) the cell's summed gradient, whole, in `named_parameters` order (a
        collective; the leader's is the one used)."""
        grads = [_sharded(p.grad).full_tensor() if p.grad is not None
                 else torch.zeros(p.shape, device=self.device)
                 for p in self.policy.model.parameters()]
        return torch.cat([g.reshape(-1) for g in grads]).to(self.device)

    def _broadcast_bytes(self, data: bytes) -> bytes:
        size = torch.tensor([len(data)], dtype=torch.long, device=self.device)
        dist.broadcast(size, src=0)
        buffer = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buffer, src=0)
        return buffer.cpu().numpy().tobytes()

    def _broadcast_json(self, value: Any) -> Any:
        return json.loads(self._broadcast_bytes(json.dumps(value).encode()))

    def _gather_json(self, value: Any) -> list[Any]:
        """Every process's `value` (each process broadcasts its own in turn)."""
        gathered = []
        for source in range(self.size):
            data = json.dumps(value).encode() if source == self.rank else b""
            size = torch.tensor([len(data)], dtype=torch.long, device=self.device)
            dist.broadcast(size, src=source)
            buffer = torch.empty(int(size), dtype=torch.uint8, device=self.device)
            if source == self.rank:
                buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            dist.broadcast(buffer, src=source)
            gathered.append(json.loads(buffer.cpu().numpy().tobytes()))
        return gathered


def weights_digest_of(policy: PolicyModel) -> str:
    """`step.weights_digest` of a sharded policy's whole weights (a collective)."""
    return tensors_digest(full_parameters(policy).items())


def cell_device_type(device: str, cuda_available: bool) -> str:
    """The mesh's device type for `learner.device` (`sharding.resolve_device`'s rule:
    "auto" is CUDA where torch sees a GPU)."""
    return "cuda" if device == "cuda" or (device == "auto" and cuda_available) else "cpu"


def _sharded(tensor: torch.Tensor) -> DTensor:
    """`tensor` (a parameter or its gradient) as the DTensor `shard_policy` made it."""
    if not isinstance(tensor, DTensor):
        raise TypeError(f"expected a sharded tensor (DTensor), got {type(tensor).__name__}; "
                        "shard the policy with shard_policy first")
    return tensor


def _wait_get(store: PrefixStore, key: str) -> bytes:
    store.wait([key])
    return store.get(key)


def cell_main(rank: int, size: int, cell_address: tuple[str, int], address: tuple[str, int],
              name: str, model_dir: str, inbox: Any, backend: str = "gloo",
              timeout_s: float = 300.0, num_threads: int = 1,
              learner: TrainConfig = CPU_LEARNER, device_index: int | None = None) -> None:
    """One process of a training cell of `size` processes (start each with the "spawn"
    context): joins the cell's process group at `cell_address` (a TCPStore its starter
    serves), shards the model over the cell's mesh, and joins each step number it reads
    from `inbox` (every process of the cell reads the same numbers) until it reads None.
    Rank 0 is the cell's leader on the coordinator's store at `address`. `backend` is
    the coordinator's final sum's; the cell's own group is NCCL's on CUDA (the process
    on cuda:`device_index`), gloo's on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(num_threads)
    device_type = cell_device_type(learner.device, torch.cuda.is_available())
    if device_type == "cuda" and device_index is not None:
        torch.cuda.set_device(device_index)
    store = TCPStore(cell_address[0], cell_address[1], is_master=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store,
                            rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        member = CellMember(address if rank == 0 else None, name, model_dir,
                            init_device_mesh(device_type, (size,)), backend, timeout_s,
                            learner)
        while (step := inbox.get()) is not None:
            member.join(step)
    finally:
        dist.destroy_process_group()
