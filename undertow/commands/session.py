"""`undertow session open|close|list`: sessions at a running gateway, for a person.

They call the gateway's admin API (`gateway/front/api/admin.py`) over HTTP, with the stdlib
only so that the command stays fast; what each prints, the variables it reads and its
errors are in docs/commands.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from undertow.commands import ADMIN_TOKEN_VARIABLE, Commands, admin_token_from_env
from undertow.errors import CommandError

GATEWAY_VARIABLE = "UNDERTOW_GATEWAY"
TIMEOUT_S = 30.0


class SessionCommandError(CommandError, ValueError):
    """The admin call could not be made or was refused; the message says what to do."""


def add(commands: Commands) -> None:
    session = commands.add_parser(
        "session", help="open, close and list sessions at a running gateway "
        f"(admin token from {ADMIN_TOKEN_VARIABLE})").add_subparsers(dest="action",
                                                                    required=True)
    open_ = session.add_parser("open", help="open a session; print the environment for "
                               "OpenAI and Anthropic clients")
    _add_common(open_)
    open_.add_argument("--group", required=True, help="the session's task group")
    open_.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                       help="metadata stored with the session (repeat for several)")
    open_.set_defaults(handler=_open)
    close = session.add_parser("close", help="close a session with its reward")
    close.add_argument("session_id", metavar="ID")
    close.add_argument("--reward", type=float, required=True)
    _add_common(close)
    close.set_defaults(handler=_close)
    list_ = session.add_parser("list", help="the gateway's sessions")
    list_.add_argument("--group", default=None, help="only this group's")
    _add_common(list_)
    list_.set_defaults(handler=_list)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", default=None, metavar="URL",
                        help=f"the gateway's URL (default: ${GATEWAY_VARIABLE})")
    parser.add_argument("--json", action="store_true", help="print JSON, for scripts")


class AdminClient:
    """The admin API of one gateway, over HTTP (stdlib only: the command stays fast)."""

    def __init__(self, url: str, token: str):
        self.url = url.rstrip("/")
        self.token = token

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method,
            headers={"Authorization": f"Bearer {self.token}",
                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as error:
            raise SessionCommandError(self._refusal(error)) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise SessionCommandError(
                f"cannot reach the gateway at {self.url} ({reason}): is it running? "
                "`undertow serve` prints its URL") from None

    def _refusal(self, error: urllib.error.HTTPError) -> str:
        if error.code == 401:
            return (f"the gateway at {self.url} refused the admin token: set "
                    f"{ADMIN_TOKEN_VARIABLE} to the token the gateway was started with "
                    "(`undertow serve` prints it)")
        try:
            message = json.loads(error.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = error.reason
        return f"the gateway at {self.url} answered {error.code}: {message}"


def client_from(args: argparse.Namespace) -> AdminClient:
    """The admin client the options and environment describe."""
    url = args.gateway or os.environ.get(GATEWAY_VARIABLE)
    if not url:
        raise SessionCommandError(f"no gateway: give --gateway URL or set {GATEWAY_VARIABLE}")
    token = admin_token_from_env()
    if not token:
        raise SessionCommandError(
            f"{ADMIN_TOKEN_VARIABLE} is not set: set it to the gateway's admin token "
            "(`undertow serve` prints it)")
    return AdminClient(url, token)


def client_environment(opened: dict[str, Any]) -> dict[str, str]:
    """The environment that points OpenAI and Anthropic clients at an opened session.
    The OpenAI SDKs take the base URL with `/v1`; the Anthropic ones add `/v1/messages`."""
    openai_base = opened["base_url"]
    return {"OPENAI_BASE_URL": openai_base, "OPENAI_API_KEY": opened["api_key"],
            "ANTHROPIC_BASE_URL": openai_base.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": opened["api_key"], "UNDERTOW_SESSION": opened["session_id"]}


def _parse_meta(pairs: list[str]) -> dict[str, str]:
    meta = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SessionCommandError(f"--meta {pair!r} is not KEY=VALUE")
        meta[key] = value
    return meta


def _open(args: argparse.Namespace) -> int:
    meta = _parse_meta(args.meta)
    opened = client_from(args).call("POST", "/admin/sessions",
                                    {"group": args.group, "meta": meta})
    environment = client_environment(opened)
    if args.json:
        print(json.dumps({**opened, "env": environment}, indent=2))
    else:
        print("\n".join(f"export {name}={shlex.quote(value)}"
                        for name, value in environment.items()))
    return 0


def _close(args: argparse.Namespace) -> int:
    closed = client_from(args).call("POST", f"/admin/sessions/{args.session_id}/close",
                                    {"reward": args.reward})
    if args.json:
        print(json.dumps(closed, indent=2))
    else:
        print(f"closed {closed['session_id']} (group {closed['group']}): reward "
              f"{closed['reward']:g}, {closed['num_calls']} calls")
    return 0


def _list(args: argparse.Namespace) -> int:
    path = "/admin/sessions" + (f"?group={urllib.parse.quote(args.group)}" if args.group
                                else "")
    sessions = client_from(args).call("GET", path)["sessions"]
    if args.json:
        print(json.dumps(sessions, indent=2))
    else:
        print(format_sessions(sessions))
    return 0


def format_sessions(sessions: list[dict[str, Any]]) -> str:
    """One line per session: ID, group, state, reward, calls, how it was opened."""
    rows = [("session", "group", "state", "reward", "calls", "opened by")]
    for s in sessions:
        state = "open" if not s["closed"] else ("closed" if s["reward"] is not None
                                                else "expired")
        reward = "-" if s["reward"] is None else f"{s['reward']:g}"
        rows.append((s["session_id"], s["group"], state, reward, str(s["num_calls"]),
                     "key" if s.get("auto") else "admin"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths,
                                                                         strict=True)).rstrip()
                     for row in rows)
