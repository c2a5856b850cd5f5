"""The learner's side of the gateway: its admin API over HTTP, synchronous (stdlib only).

The learner never imports gateway internals; it reads finished group trees
(`GET /admin/groups/{group}/tree`) and publishes new weights
(`POST /admin/update_weights {model_path, weight_version, mode}`: the pool pauses,
every engine loads the directory with `update_weights_from_disk`, the pool resumes).
The cell pool also counts a group's closed sessions (`GET /admin/sessions`) and
adds, drains and removes engines (`/admin/engines`) as cells change roles.
`EngineWeightSink` pushes straight to engines (SGLang's `POST /update_weights_from_disk`)
where no gateway pool stands in between.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from undertow.gateway.trees.tree import Tree, tree_from_json
from undertow.learner.errors import LearnerError


class GatewayLinkError(LearnerError):
    """The gateway's admin API refused or failed a request; `status` is its HTTP status
    (None when the gateway was not reached)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class GroupSetAside(GatewayLinkError):
    """The gateway set the group aside: a line of its store file is damaged (the message
    names the file and line), so its tree cannot be read until `undertow trees repair`.
    For training the group is an infra failure (`rollout_source.ThreadedGroupSource`)."""


class GatewayLink:
    """Admin calls to one gateway at `url` with the admin `token`."""

    def __init__(self, url: str, token: str, timeout_s: float = 600.0,
                 push_mode: str = "drain"):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.push_mode = push_mode

    def request(self, method: str, path: str, body: dict[str, Any] | None = None
                ) -> dict[str, Any]:
        return _request(self.url, method, path, body, self.timeout_s,
                        {"Authorization": f"Bearer {self.token}"})

    def group_tree(self, group: str) -> Tree:
        """The group's tree; raises `GroupSetAside` for a group whose store file is
        damaged (the gateway's 503 for it)."""
        try:
            return tree_from_json(self.request("GET", f"/admin/groups/{group}/tree"))
        except GatewayLinkError as error:
            if error.status == 503 and f"group {group} is set aside" in str(error):
                raise GroupSetAside(str(error), error.status) from None
            raise

    def update_weights(self, model_dir: Path, weight_version: int, mode: str = "drain"
                       ) -> dict[str, Any]:
        """Pushes `model_dir` to every engine as `weight_version`; raises when any failed."""
        result = self.request("POST", "/admin/update_weights",
                              {"model_path": str(Path(model_dir).resolve()),
                               "weight_version": int(weight_version), "mode": mode})
        if result.get("failed"):
            raise GatewayLinkError(f"engines failed to load {model_dir}: {result['failed']}")
        return result

    def push(self, model_dir: Path, weight_version: int) -> None:
        """`WeightSink` of the training loop: through the gateway's pool."""
        self.update_weights(model_dir, weight_version, self.push_mode)

    def sessions(self, group: str | None = None) -> list[dict[str, Any]]:
        """The sessions of `group`, or all (each with `session_id`, `group`, `closed`, ...)."""
        query = "" if group is None else f"?group={urllib.parse.quote(group)}"
        return self.request("GET", f"/admin/sessions{query}")["sessions"]

    def engines(self) -> list[dict[str, Any]]:
        """The gateway's engines: `id`, `url`, `state`, `num_in_flight`,
        `num_pinned_sessions`, `weight_version`."""
        return self.request("GET", "/admin/engines")["engines"]

    def add_engine(self, url: str) -> dict[str, Any]:
        """Adds a running engine to the gateway's pool; returns its record (with `id`)."""
        return self.request("POST", "/admin/engines", {"url": url})

    def drain_engine(self, engine_id: str, migrate: bool = True) -> dict[str, Any]:
        """No new calls go to the engine; with `migrate` its in-flight generations are
        resumed on other engines from their partial output."""
        return self.request("POST", f"/admin/engines/{engine_id}/drain", {"migrate": migrate})

    def remove_engine(self, engine_id: str, migrate: bool = True) -> None:
        """Drains the engine, waits until nothing of the gateway runs on it, drops it."""
        self.request("DELETE", f"/admin/engines/{engine_id}?migrate={str(migrate).lower()}")


class EngineWeightSink:
    """`WeightSink` straight to engines (no gateway): `update_weights_from_disk` on each."""

    def __init__(self, engine_urls: list[str], timeout_s: float = 600.0):
        self.engine_urls = [url.rstrip("/") for url in engine_urls]
        self.timeout_s = timeout_s

    def push(self, model_dir: Path, weight_version: int) -> None:
        for url in self.engine_urls:
            result = _request(url, "POST", "/update_weights_from_disk",
                              {"model_path": str(Path(model_dir).resolve()),
                               "weight_version": str(weight_version)}, self.timeout_s)
            if not result.get("success"):
                raise GatewayLinkError(f"engine {url} did not load {model_dir}: "
                                       f"{result.get('message')}")


def _request(base_url: str, method: str, path: str, body: dict[str, Any] | None,
             timeout_s: float, headers: dict[str, str] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:500]
        raise GatewayLinkError(f"{method} {base_url}{path} answered {error.code}: "
                               f"{detail}", error.code) from None
    except urllib.error.URLError as error:
        raise GatewayLinkError(f"{method} {base_url}{path}: not reachable ({error.reason}); "
                               "is the server running?") from None
