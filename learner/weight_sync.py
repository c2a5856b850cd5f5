"""Weights from the learner to SGLang engines through SGLang's own update APIs (SGLang
0.5.23): `EngineWeightSync`, a `WeightSink` (`train.py`) that talks to the engines directly,
from disk or by a `torch.distributed` broadcast (`WeightSyncConfig.method`). Field names are
those of SGLang's `srt/managers/io_struct.py` (`InitWeightsUpdateGroupReqInput`,
`UpdateWeightsFromDistributedReqInput`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]  # public in torch's docs; re-exported without __all__

from undertow.learner.errors import LearnerError
from undertow.learner.gateway_link import GatewayLinkError, _request

log = logging.getLogger(__name__)

METHODS = ("disk", "distributed")


class WeightSyncError(LearnerError):
    """The distributed path failed; the message says where (the push falls back to disk)."""


@dataclass(frozen=True)
class WeightSyncConfig:
    """How weights reach the engines.

    `master_address` must be an address of the learner's host that every engine can reach;
    `master_port` 0 picks a free port per group; `group_timeout_s` bounds forming the group
    and each broadcast; `timeout_s` bounds each HTTP call (a load from disk can be slow).
    """

    method: str = "disk"
    backend: str = "nccl"
    master_address: str = "127.0.0.1"
    master_port: int = 0
    group_name: str = "undertow_weights"
    group_timeout_s: float = 120.0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"weight sync method {self.method!r} is unknown; choose one of "
                             f"{METHODS}")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={self.backend!r} must be nccl (GPUs) or gloo (CPUs)")
        if self.group_timeout_s <= 0 or self.timeout_s <= 0:
            raise ValueError("group_timeout_s and timeout_s must be > 0")


@dataclass(frozen=True)
class SyncReport:
    """One push: `method` is how the weights got there; `fallback_error` is set when the
    distributed path was tried and failed (then `method` is "disk")."""

    weight_version: int
    method: str
    seconds: float
    num_bytes: int
    fallback_error: str | None = None


@dataclass
class _Group:
    """The learner's side of an open weight-update group."""

    backend: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
    store: TCPStore
    device: torch.device
    world_size: int


@dataclass
class EngineWeightSync:
    """`WeightSink` to SGLang engines at `engine_urls`. "disk": `POST
    /update_weights_from_disk {model_path, weight_version}` on each (the engines must see
    the learner's file system). "distributed": the learner is rank 0 of a group whose
    other ranks are the engines' tensor-parallel workers (`_open_group`, once, reused by
    every push), and broadcasts every tensor to them between `POST /begin_weight_update`
    and `/end_weight_update` (SGLang 0.5.23 refuses the update outside such a session,
    `srt/managers/scheduler_components/weight_updater.py`; a server without it needs
    none). The tensors are the model directory's safetensors (just written, so read from
    the page cache) or `named_tensors()` (e.g. the live `state_dict().items()`), by their
    Hugging Face names. SGLang's `tensor` path is not offered: it takes CUDA IPC handles
    on the engine's own node.

    When the distributed path fails (an engine refuses or cannot join, a broadcast times
    out, an engine cannot load what it got), the group is given up, the push falls back
    to disk with a warning and a `SyncReport` in `reports`, and the next push tries a new
    group. An engine left waiting in an abandoned broadcast answers nothing until its own
    group timeout (SGLang's default: 30 minutes), so that push's disk load waits too."""

    engine_urls: list[str]
    config: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None
    reports: list[SyncReport] = field(default_factory=list)
    _group: _Group | None = None

    def push(self, model_dir: Path, weight_version: int) -> None:
        started = time.perf_counter()
        fallback_error = None
        if self.config.method == "distributed":
            try:
                num_bytes = self._push_distributed(Path(model_dir), weight_version)
                self._report(weight_version, "distributed", started, num_bytes)
                return
            except WeightSyncError as error:
                fallback_error = str(error)
                log.warning("weights %s: the distributed update failed (%s); loading them "
                            "from disk (%s) instead", weight_version, error, model_dir)
                self.close()
        num_bytes = self._push_disk(Path(model_dir), weight_version)
        self._report(weight_version, "disk", started, num_bytes, fallback_error)

    def open(self) -> _Group:
        """Form the weight-update group now (the first distributed push does it otherwise)."""
        if self._group is None:
            self._group = self._open_group()
        return self._group

    def close(self) -> None:
        """Give up the group (the engines are asked to destroy their side, best effort)."""
        group, self._group = self._group, None
        if group is None:
            return
        for url in self.engine_urls:
            with contextlib.suppress(GatewayLinkError):
                _request(url, "POST", "/destroy_weights_update_group",
                         {"group_name": self.config.group_name}, self.config.group_timeout_s)

    def _report(self, weight_version: int, method: str, started: float, num_bytes: int,
                fallback_error: str | None = None) -> None:
        self.reports.append(SyncReport(weight_version, method, time.perf_counter() - started,
                                       num_bytes, fallback_error))

    def _push_disk(self, model_dir: Path, weight_version: int) -> int:
        for url in self.engine_urls:
            result = _request(url, "POST", "/update_weights_from_disk",
                              {"model_path": str(model_dir.resolve()),
                               "weight_version": str(weight_version)}, self.config.timeout_s)
            if not result.get("success"):
                raise GatewayLinkError(f"engine {url} did not load {model_dir}: "
                                       f"{result.get('message')}")
        return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))

    def _tensors(self, model_dir: Path) -> list[tuple[str, torch.Tensor]]:
        if self.named_tensors is not None:
            return [(name, tensor.detach()) for name, tensor in self.named_tensors()]
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        if not tensors:
            raise WeightSyncError(f"{model_dir} holds no *.safetensors file to broadcast")
        return list(tensors.items())

    def _push_distributed(self, model_dir: Path, weight_version: int) -> int:
        tensors = self._tensors(model_dir)
        group = self.open()
        body = {"names": [name for name, _ in tensors],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors],
                "group_name": self.config.group_name, "flush_cache": True,
                "weight_version": str(weight_version)}
        self._session_call("/begin_weight_update", {})
        try:
            updates = [_in_thread(_request, url, "POST", "/update_weights_from_distributed",
                                  body, self.config.timeout_s) for url in self.engine_urls]
            self._broadcast(group, tensors, updates)
            replies = _results(updates, self.config.timeout_s, "update_weights_from_distributed")
        finally:
            self._session_call("/end_weight_update", {})
        refused = [f"{url}: {reply.get('message')}"
                   for url, reply in zip(self.engine_urls, replies, strict=True)
                   if not reply.get("success")]
        if refused:
            raise WeightSyncError(f"engines refused the broadcast weights: {refused}")
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def _broadcast(self, group: _Group, tensors: list[tuple[str, torch.Tensor]],
                   updates: list[concurrent.futures.Future]) -> None:
        """Broadcast every tensor from rank 0, in order; an engine whose update call ends
        early (refused before receiving) makes it fail instead of waiting for the timeout."""
        timeout = timedelta(seconds=self.config.group_timeout_s)
        try:
            works = [group.backend.broadcast(  # pyright: ignore[reportAttributeAccessIssue]  # torch's stubs leave it out of Backend
                t.to(group.device).contiguous(), 0, timeout) for _, t in tensors]
            for work in works:
                while not work.is_completed():
                    _raise_if_failed(updates, "update_weights_from_distributed")
                    time.sleep(0.005)
                work.wait()
        except WeightSyncError:
            raise
        except RuntimeError as error:  # a peer left or the broadcast timed out
            raise WeightSyncError(f"the broadcast of the weights failed: {error}") from error

    def _session_call(self, path: str, body: dict) -> None:
        """begin/end_weight_update on every engine; a server without them (404) needs none."""
        for url in self.engine_urls:
            try:
                reply = _request(url, "POST", path, body, self.config.timeout_s)
            except GatewayLinkError as error:
                if " answered 404" in str(error):
                    continue
                raise WeightSyncError(f"{path} failed: {error}") from error
            if not reply.get("success", True):
                raise WeightSyncError(f"{url}{path} refused: {reply.get('message')}")

    def _open_group(self) -> _Group:
        """Form the group: rank 0 here, engine i's workers from `rank_offset` = 1 + the
        `tp_size`s (`/server_info`) of the engines before it, by `POST
        /init_weights_update_group` on each while this side joins."""
        c = self.config
        tp_sizes = [self._tp_size(url) for url in self.engine_urls]
        world_size = 1 + sum(tp_sizes)
        port = c.master_port or _free_port(c.master_address)
        timeout = timedelta(seconds=c.group_timeout_s)
        try:
            store = TCPStore(c.master_address, port, world_size, is_master=True,
                                  timeout=timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as error:
            raise WeightSyncError(f"cannot serve the group's store at {c.master_address}:"
                                  f"{port}: {error}") from error
        inits, offset = [], 1
        for url, tp_size in zip(self.engine_urls, tp_sizes, strict=True):
            inits.append(_in_thread(_request, url, "POST", "/init_weights_update_group", {
                "master_address": c.master_address, "master_port": port, "rank_offset": offset,
                "world_size": world_size, "group_name": c.group_name, "backend": c.backend},
                c.timeout_s))
            offset += tp_size
        joined = _in_thread(self._join, store, world_size)
        while not joined.done():  # an engine that refuses ends the wait at once
            _raise_if_failed(inits, "init_weights_update_group")
            time.sleep(0.01)
        group = _result(joined, "joining the group")
        for url, reply in zip(self.engine_urls,
                              _results(inits, c.timeout_s, "init_weights_update_group"),
                              strict=True):
            if not reply.get("success"):
                raise WeightSyncError(f"{url} did not join the group: {reply.get('message')}")
        return group

    def _join(self, store: TCPStore, world_size: int) -> _Group:
        c = self.config
        device = "cuda" if c.backend == "nccl" else "cpu"
        # The rendezvous follows SGLang's init_custom_process_group (srt/utils/common.py):
        # a TCP store served by rank 0, keys under `{group_name}`, then `{group_name}/` and
        # `{device}/` (added by torch's _new_process_group_helper), so this side needs only
        # torch's public store and backend classes. With gloo, each side's address comes
        # from its hostname unless GLOO_SOCKET_IFNAME names an interface.
        prefixed = PrefixStore(f"{device}/", PrefixStore(
            f"{c.group_name}/", PrefixStore(c.group_name, store)))
        timeout = timedelta(seconds=c.group_timeout_s)
        if c.backend == "gloo":
            backend = dist.ProcessGroupGloo(prefixed, 0, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend = dist.ProcessGroupNCCL(prefixed, 0, world_size, options)
        return _Group(backend=backend, store=store, device=torch.device(device),
                      world_size=world_size)

    def _tp_size(self, url: str) -> int:
        for path in ("/server_info", "/get_server_info"):
            with contextlib.suppress(GatewayLinkError):
                return int(_request(url, "GET", path, None, self.config.timeout_s)
                           .get("tp_size") or 1)
        raise WeightSyncError(f"{url} answered neither /server_info nor /get_server_info")


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _in_thread(fn, *args) -> concurrent.futures.Future:
    """Run `fn(*args)` in a daemon thread (one blocked in a collective or an HTTP call the
    learner gave up on must not hold the process at exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # handed to whoever waits on the future
            future.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return future


def _raise_if_failed(futures: list[concurrent.futures.Future], what: str) -> None:
    for future in futures:
        if future.done() and (future.exception() is not None
                              or not future.result().get("success")):
            _result(future, what)
            raise WeightSyncError(f"{what} was refused: {future.result().get('message')}")


def _result(future: concurrent.futures.Future, what: str):
    try:
        return future.result()
    except (GatewayLinkError, RuntimeError, OSError) as error:
        raise WeightSyncError(f"{what} failed: {error}") from error


def _results(futures: list[concurrent.futures.Future], timeout_s: float, what: str) -> list:
    _, pending = concurrent.futures.wait(futures, timeout=timeout_s)
    if pending:
        raise WeightSyncError(f"{what}: {len(pending)} engines did not answer in {timeout_s} s")
    return [_result(future, what) for future in futures]
