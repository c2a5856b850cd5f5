"""The gateway's configuration: one frozen dataclass, built by the command line
(`undertow gateway serve`) or by tests, and validated on creation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from undertow.gateway.engine_pool.router import RouterConfig
from undertow.gateway.errors import BadRequest
from undertow.gateway.front.store import check_group

REOPEN_POLICIES = ("never", "expired", "closed")


@dataclass(frozen=True)
class AutoSessionsConfig:
    """Sessions opened by the API keys clients bring, for interactive collection (a
    person working with Claude Code or Codex against the gateway, no admin step).

    With it, a request to a bare route (`/v1/...`) whose key the gateway does not know
    opens a session in `group` on first use, keyed by that key, so each distinct key is
    its own session. A session so opened closes by the admin API (with a reward) or
    after `idle_close_s` without a call, with no reward (not trained until one is set).
    The idle check runs every `check_interval_s`.

    `reopen` says what a call with a closed session's key gets: "expired" (the default)
    opens a new session of the same group under the key when the old one expired for
    idleness, and refuses the key (401) when an operator closed it with a reward;
    "closed" reopens either; "never" refuses both. A reopened key's old session stays as
    it was (its calls, its reward or none); the new one has its own ID. The default
    because expiry is the gateway's own timeout, not anyone's decision that the work is
    done: agents that keep their key in a config file (opencode, aider) come back with it
    on their next run, and refusing it forever means editing that file per session. A
    close with a reward is such a decision (the session is scored), so calls on its key
    afterwards are more likely something left running than new work.
    """

    group: str
    idle_close_s: float = 1800.0
    check_interval_s: float = 10.0
    reopen: str = "expired"

    def __post_init__(self) -> None:
        try:
            check_group(self.group)
        except BadRequest as error:
            raise ValueError(f"auto-sessions: {error.message}") from None
        if self.idle_close_s <= 0:
            raise ValueError(f"idle_close_s={self.idle_close_s} must be positive")
        if self.check_interval_s <= 0:
            raise ValueError(f"check_interval_s={self.check_interval_s} must be positive")
        if self.reopen not in REOPEN_POLICIES:
            raise ValueError(f"auto-sessions: reopen={self.reopen!r}: choose one of "
                             f"{', '.join(REOPEN_POLICIES)}")

    def reopens(self, expired: bool) -> bool:
        """Whether a call with the key of a closed auto session opens a new one
        (`expired`: it closed for idleness, not with a reward)."""
        return self.reopen == "closed" or (self.reopen == "expired" and expired)

    def describe(self) -> str:
        """The start-up line that says auto-sessions are on."""
        reopening = {"never": "its key is refused from then on",
                     "expired": "its key opens a new session on its next call",
                     "closed": "its key opens a new session on its next call, as does the "
                               "key of one closed with a reward"}[self.reopen]
        return (f"auto-sessions on: an unknown API key opens a session in group "
                f"{self.group!r} on first use (one per key); idle {self.idle_close_s:g} s, it "
                f"closes without a reward and {reopening} (reopen: {self.reopen})")


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway process needs. `admin_token` guards `/admin/...`;
    an empty token refuses every admin call (the CLI reads it from the environment).

    `context_length` of 0 means: take the model directory's limit.
    `keepalive_s` is the longest silence on a streaming reply before a keep-alive.
    `store_sync` ("flush" or "fsync"), `store_max_idle_trees`, `store_hold_max_bytes` and
    `store_hold_max_s` (`store_hold_max_bytes=0` holds nothing): docs/api.md, "When the
    store's disk fills, or a log is damaged" and "Memory over a long run".
    `router`: admission bounds and routing affinity (docs/api.md, "When every engine is
    busy"; `engine_pool/router.py`, `engine_pool/admission_queue.py`).
    `auto_sessions`: None (the default) refuses unknown keys; see `AutoSessionsConfig`.
    `token_truth`: "verbatim" (the default: a call's prompt reuses the session's sampled IDs
    verbatim) or "template" (every prompt is the template's full render); see
    `tokentruth.py` and the README.
    """

    model_dir: Path
    store_dir: Path
    engine_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0
    admin_token: str = ""
    model_name: str = "undertow"
    tool_parser: str = "auto"
    max_body_bytes: int = 32 * 2**20
    context_length: int = 0
    default_max_tokens: int = 4096
    max_n: int = 16
    keepalive_s: float = 10.0
    num_heads_per_session: int = 16
    store_sync: str = "flush"
    store_max_idle_trees: int = 64
    store_hold_max_bytes: int = 64 * 2**20
    store_hold_max_s: float = 300.0
    router: RouterConfig = field(default_factory=RouterConfig)
    auto_sessions: AutoSessionsConfig | None = None
    token_truth: str = "verbatim"

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} must be positive")
        if self.context_length < 0:
            raise ValueError(f"context_length={self.context_length} must be >= 0 (0 = model's)")
        if self.keepalive_s <= 0:
            raise ValueError(f"keepalive_s={self.keepalive_s} must be positive")
        if not 1 <= self.max_n <= 128:
            raise ValueError(f"max_n={self.max_n} must be in 1..128")
        if self.num_heads_per_session < 1:
            raise ValueError(f"num_heads_per_session={self.num_heads_per_session} must be >= 1")
        if self.store_sync not in ("flush", "fsync"):
            raise ValueError(f"store_sync={self.store_sync!r} must be 'flush' or 'fsync'")
        if self.store_max_idle_trees < 0:
            raise ValueError(f"store_max_idle_trees={self.store_max_idle_trees} must be >= 0 "
                             "(0 keeps no idle group's tree in memory)")
        if self.token_truth not in ("verbatim", "template"):
            raise ValueError(f"token_truth={self.token_truth!r} must be 'verbatim' or "
                             "'template'")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is not a TCP port")
