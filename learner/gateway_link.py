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

import contextlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

from undertow.gateway.trees.tree import Tree, tree_from_json
from undertow.learner.errors import LearnerError

RESTART_POLL_S = 0.5
SET_ASIDE = "group_set_aside"   # the gateway's error code for a group it set aside


class GatewayLinkError(LearnerError):
    """The gateway's admin API refused or failed a request; `status` is its HTTP status
    (None when the gateway was not reached) and `reply` its JSON body (None if not JSON)."""

    def __init__(self, message: str, status: int | None = None, reply: Any = None):
        super().__init__(message)
        self.status, self.reply = status, reply


class EngineDropped(LearnerError, UserWarning):
    """An engine the user started died during a weight update and left the pool."""


class GroupSetAside(GatewayLinkError):
    """The gateway set the group aside: a line of its store file is damaged (the message
    names the file and line), so its tree cannot be read until `undertow trees repair`.
    For training the group is an infra failure (`rollout_source.ThreadedGroupSource`)."""


class GatewayLink:
    """Admin calls to one gateway at `url` with the admin `token`. `launched_urls`: the
    engines Undertow launched, which are started again should they die
    (`engine_keeper.py`); a weight push waits up to `restart_timeout_s` for such an engine
    to come back, where it drops an engine the user started (see `update_weights`)."""

    def __init__(self, url: str, token: str, timeout_s: float = 600.0,
                 push_mode: str = "drain", launched_urls: Collection[str] = (),
                 restart_timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.push_mode = push_mode
        self.launched_urls = {u.rstrip("/") for u in launched_urls}
        self.restart_timeout_s = restart_timeout_s

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
            body = error.reply if isinstance(error.reply, dict) else {}
            if error.status == 503 and (body.get("error") or {}).get("code") == SET_ASIDE:
                raise GroupSetAside(str(error), error.status) from None
            raise

    def update_weights(self, model_dir: Path, weight_version: int, mode: str = "drain",
                       launched_urls: Collection[str] | None = None) -> dict[str, Any]:
        """Pushes `model_dir` to every engine as `weight_version`. An engine that refused
        the weights raises `GatewayLinkError`. One that died loading them (the result's
        `dead`) does not stop the run: one Undertow launched (`launched_urls`, default
        the link's) is waited for until it serves again, restarted, and the weights are
        pushed once more; one the user started is drained and removed from the pool, with
        a warning. Raises when no engine serves afterwards."""
        result = self._push(model_dir, weight_version, mode)
        dead: set[str] = {str(e) for e in result.get("dead") or ()}
        if dead:
            launched = self.launched_urls if launched_urls is None else {
                u.rstrip("/") for u in launched_urls}
            if self._recover(model_dir, dead, launched):
                result = self._push(model_dir, weight_version, mode)
                if result.get("dead"):
                    raise GatewayLinkError(
                        f"engines {result['dead']} died loading {model_dir} again after "
                        "their restart; the checkpoint kills them: check it (undertow "
                        "model check) and its engine logs")
            if not any(e["state"] == "healthy" for e in self.engines()):
                raise GatewayLinkError(f"no engine serves after the push of {model_dir}: "
                                       f"every engine died loading it ({sorted(dead)})")
        return result

    def _push(self, model_dir: Path, weight_version: int, mode: str) -> dict[str, Any]:
        """One `POST /admin/update_weights` (its 502 names the engines that failed);
        raises for an engine that refused the weights."""
        try:
            result = self.request("POST", "/admin/update_weights",
                                  {"model_path": str(Path(model_dir).resolve()),
                                   "weight_version": int(weight_version), "mode": mode})
        except GatewayLinkError as error:
            if error.status != 502 or not isinstance(error.reply, dict) or \
                    "failed" not in error.reply:
                raise
            result = error.reply
        dead = set(result.get("dead") or ())
        refused = {e: why for e, why in (result.get("failed") or {}).items() if e not in dead}
        if refused:
            raise GatewayLinkError(f"engines failed to load {model_dir}: {refused}")
        return result

    def _recover(self, model_dir: Path, dead: set[str], launched: set[str]) -> bool:
        """Drops the dead engines the user started (warned), waits until those Undertow
        launched serve again; True when any of those came back."""
        urls = {e["id"]: e["url"].rstrip("/") for e in self.engines()}
        restarted = {e for e in dead if urls.get(e) in launched}
        for engine_id in sorted(dead - restarted):
            warnings.warn(
                f"engine {engine_id} at {urls.get(engine_id)} died loading {model_dir}; it "
                "was started outside Undertow, so it is drained and removed from the pool "
                "and the run goes on with the others. Restart it and add it back with POST "
                "/admin/engines (or restart the run)", EngineDropped, stacklevel=3)
            with contextlib.suppress(GatewayLinkError):   # already gone: nothing to drop
                self.remove_engine(engine_id, migrate=True)
        deadline_s = time.monotonic() + self.restart_timeout_s
        while restarted and time.monotonic() < deadline_s:
            states = {e["id"]: e["state"] for e in self.engines()}
            if all(states.get(e) == "healthy" for e in restarted):
                return True
            time.sleep(RESTART_POLL_S)
        if restarted:
            raise GatewayLinkError(
                f"engines {sorted(restarted)} died loading {model_dir} and did not serve "
                f"again within {self.restart_timeout_s:.0f} s of their restart; see their "
                "engine logs (each restart writes its own, `*-restart-N.log`)")
        return False

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
        text = error.read().decode(errors="replace")
        try:
            reply = json.loads(text)
        except ValueError:
            reply = None
        raise GatewayLinkError(f"{method} {base_url}{path} answered {error.code}: "
                               f"{text[:500]}", error.code, reply) from None
    except urllib.error.URLError as error:
        raise GatewayLinkError(f"{method} {base_url}{path}: not reachable ({error.reason}); "
                               "is the server running?") from None
