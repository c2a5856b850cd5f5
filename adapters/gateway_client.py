"""The gateway's admin API, over HTTP: what the rollout runner needs of it.

Adapters never import the gateway's code; they open and close sessions and read
trees through `/admin/...` with the admin token, as any operator would.
"""

from typing import Any

import aiohttp

from undertow.adapters.errors import GatewayAdminError


class GatewayAdmin:
    """An admin client of one gateway. Use as an async context manager (or `close()`)."""

    def __init__(self, url: str, admin_token: str, timeout_s: float = 120):
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {admin_token}"}
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def __aenter__(self) -> "GatewayAdmin":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.close()

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        try:
            async with self._http.request(method, self.url + path, json=body,
                                          headers=self._headers) as reply:
                text = await reply.text()
                if reply.status >= 400:
                    raise GatewayAdminError(
                        f"{method} {path} at the gateway {self.url} answered {reply.status}: "
                        f"{text[:500]}")
                return await reply.json(content_type=None)
        except aiohttp.ClientError as error:
            raise GatewayAdminError(f"{method} {path}: the gateway at {self.url} cannot be "
                                    f"reached ({error}); is it running?") from None

    async def health(self) -> dict[str, Any]:
        return await self._call("GET", "/health")

    async def open_session(self, group: str, meta: dict[str, Any] | None = None
                           ) -> dict[str, Any]:
        """`{session_id, api_key, group, base_url}` of a new session in `group`."""
        return await self._call("POST", "/admin/sessions", {"group": group, "meta": meta or {}})

    async def close_session(self, session_id: str, reward: float,
                            meta: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", f"/admin/sessions/{session_id}/close",
                                {"reward": reward, "meta": meta})

    async def session(self, session_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/admin/sessions/{session_id}")

    async def session_tree(self, session_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/admin/sessions/{session_id}/tree")

    async def group_tree(self, group: str) -> dict[str, Any]:
        return await self._call("GET", f"/admin/groups/{group}/tree")
