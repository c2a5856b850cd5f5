"""A test server that plays an SGLang 0.5.23 engine's side of weight updates, in its own process.

    python -m tests.learner.sglang_weight_receiver --model DIR [--fail-init]

It holds a model's tensors (read from DIR's safetensors, as the engine loads them) and
answers, as SGLang 0.5.23 does (paths as in the `sglang==0.5.23` wheel, `sglang/srt/...`):
- `POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
  group_name, backend}` (`entrypoints/http_server.py`; `model_executor/model_runner_components/
  weight_updater.py`, `init_weights_update_group`): with a default process group already up
  (the engine's TP group; here one of world size 1), rank = rank_offset + tp_rank (0) joins
  the group through `init_custom_process_group` (`utils/common.py`), copied below: a TCP
  rendezvous at the master, a `PrefixStore(group_name)`, torch's `_new_process_group_helper`.
  200 `{success: true}`, or 400 `{success: false, message: "Failed to initialize custom
  process group: ..."}`; `--fail-init` answers that at once (an engine that cannot reach the
  learner's address), the fault switch of the fallback test.
- `POST /begin_weight_update`, `POST /end_weight_update` (`managers/scheduler_components/
  weight_updater.py`): open and close the one update session; a second begin, or an end
  without a begin, is refused.
- `POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
  weight_version}`: refused outside a session; else one `torch.distributed.broadcast` from
  rank 0 per tensor, all started async and then waited for (`receive_weights_from_distributed`),
  then loaded (copied into the parameters, as the model's weight loaders do): a name the
  model does not have or a shape that differs fails the load ("Failed to update parameter
  online: ..."); on success the weight version is recorded.
- `POST /destroy_weights_update_group {group_name}`, `POST /update_weights_from_disk
  {model_path, weight_version}`, `GET /server_info` (with `tp_size`), `GET /model_info`.
- Test-only: `POST /undertow_test/save {path}` writes the tensors it holds to a safetensors
  file, so the test compares them with the learner's.
It prints `listening on http://127.0.0.1:PORT` once it serves.
"""

import argparse
import json
import socket
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file


def init_custom_process_group(backend, init_method, timeout, world_size, rank, group_name):
    """SGLang 0.5.23's `srt/utils/common.py` `init_custom_process_group`, without options."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def read_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


class Receiver:
    """The engine's state: its tensors, weight version, update groups and session."""

    def __init__(self, model_dir: str, fail_init: bool):
        self.tensors = {name: t.clone() for name, t in read_tensors(model_dir).items()}
        self.weight_version = "0"
        self.groups: dict[str, object] = {}
        self.session = False
        self.fail_init = fail_init

    def init_weights_update_group(self, body: dict) -> tuple[bool, str]:
        if self.fail_init:
            return False, ("Failed to initialize custom process group: connecting to "
                           f"{body['master_address']}:{body['master_port']} timed out.")
        try:
            self.groups[body.get("group_name", "weight_update_group")] = (
                init_custom_process_group(
                    body.get("backend", "nccl"),
                    f"tcp://{body['master_address']}:{body['master_port']}",
                    timedelta(seconds=60), body["world_size"], body["rank_offset"] + 0,
                    body.get("group_name", "weight_update_group")))
            return True, "Succeeded to initialize custom process group."
        except Exception as error:  # answered as SGLang answers it
            return False, f"Failed to initialize custom process group: {error}."

    def begin(self, body: dict) -> tuple[bool, str]:
        if self.session:
            return False, ("a weight-update session is already open; call "
                           "end_weight_update() first")
        self.session = True
        return True, "Success"

    def end(self, body: dict) -> tuple[bool, str]:
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_distributed(self, body: dict) -> tuple[bool, str]:
        if not self.session:
            return False, ("update_weights_from_distributed must run between "
                           "begin_weight_update() and end_weight_update()")
        group = self.groups[body.get("group_name", "weight_update_group")]
        received, handles = [], []
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"],
                                      strict=True):
            weight = torch.empty(shape, dtype=getattr(torch, dtype))
            handles.append(dist.broadcast(weight, src=0, group=group, async_op=True))
            received.append((name, weight))
        for handle in handles:
            handle.wait()
        for name, weight in received:
            if name not in self.tensors or self.tensors[name].shape != weight.shape:
                return False, (f"Failed to update parameter online: {name} "
                               f"{tuple(weight.shape)} is not a parameter of the model. The "
                               "full weights of the ModelRunner are partially updated. Please "
                               "discard the whole weights.")
        for name, weight in received:  # into the parameters, as the model's weight loaders do
            self.tensors[name].copy_(weight)
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return True, "Succeeded to update parameter online."

    def destroy(self, body: dict) -> tuple[bool, str]:
        group = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        dist.destroy_process_group(group)
        return True, "Succeeded to destroy custom process group."

    def update_weights_from_disk(self, body: dict) -> tuple[bool, str]:
        loaded = read_tensors(body["model_path"])
        if any(name not in self.tensors or self.tensors[name].shape != tensor.shape
               for name, tensor in loaded.items()):
            return False, "Failed to update weights: the checkpoint does not fit the model."
        for name, tensor in loaded.items():  # copied into the parameters (page-ins included)
            self.tensors[name].copy_(tensor)
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return True, "Succeeded to update model weights."


def handler_for(receiver: Receiver):
    posts = {"/init_weights_update_group": receiver.init_weights_update_group,
             "/begin_weight_update": receiver.begin, "/end_weight_update": receiver.end,
             "/update_weights_from_distributed": receiver.update_weights_from_distributed,
             "/destroy_weights_update_group": receiver.destroy,
             "/update_weights_from_disk": receiver.update_weights_from_disk}

    class Handler(BaseHTTPRequestHandler):
        def reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/server_info":
                self.reply(200, {"tp_size": 1, "weight_version": receiver.weight_version})
            elif self.path == "/model_info":
                self.reply(200, {"weight_version": receiver.weight_version})
            else:
                self.reply(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)) or b"{}")
            if self.path == "/undertow_test/save":
                save_file({k: v.contiguous() for k, v in receiver.tensors.items()},
                          body["path"])
                self.reply(200, {"success": True})
            elif self.path in posts:
                success, message = posts[self.path](body)
                self.reply(200 if success else 400, {"success": success, "message": message})
            else:
                self.reply(404, {"detail": "Not Found"})

        def log_message(self, *args):
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--fail-init", action="store_true")
    args = parser.parse_args()
    with socket.socket() as probe:  # the engine's own (TP) default group, as SGLang has one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(Receiver(args.model,
                                                                         args.fail_init)))
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
