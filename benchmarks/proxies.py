"""Starting the proxies the gateway benchmark measures, and talking to them.

The gateway (`undertow gateway serve`), the bare relay (`benchmarks.bare_relay`) and
LiteLLM's proxy run as subprocesses; their CPU time is read from /proc. See `benchmarks.gateway`.
"""

import asyncio
import contextlib
import json
import os
import socket
import sys
from pathlib import Path

import aiohttp

ADMIN_TOKEN = "bench-admin-token"
LITELLM_KEY = "sk-bench-" + "0123456789abcdef" * 4  # the proxy refuses to start without one
TIMEOUT = aiohttp.ClientTimeout(total=600)


def cpu_ns(pid: int) -> int:
    """CPU time of every live thread of process `pid`, in ns (schedstat: exact, unlike
    /proc/PID/stat's 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):  # the thread ended
            total += int((task / "schedstat").read_text().split()[0])
    return total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def start_gateway(engine_url: str, model_dir: Path, store_dir: Path,
                        context_length: int = 0, store_sync: str = "flush"
                        ) -> tuple[asyncio.subprocess.Process, str]:
    command = [sys.executable, "-m", "undertow.cli", "gateway", "serve", "--engine", engine_url,
               "--model", str(model_dir), "--store", str(store_dir), "--port", "0",
               f"context_length={context_length}", f"store_sync={store_sync}"]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "UNDERTOW_ADMIN_TOKEN": ADMIN_TOKEN})
    return process, await listening_url(process, "the gateway")


async def start_bare_relay(engine_url: str, prompt_ids: list[int]
                           ) -> tuple[asyncio.subprocess.Process, str]:
    """`benchmarks.bare_relay` in front of `engine_url`, generating from `prompt_ids`."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.bare_relay", engine_url, json.dumps(prompt_ids),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        cwd=Path(__file__).parent.parent)
    return process, await listening_url(process, "the bare relay")


async def listening_url(process: asyncio.subprocess.Process, name: str) -> str:
    """The URL in the "... listening on URL" line that `process` prints once it serves."""
    while True:
        line = (await asyncio.wait_for(process.stdout.readline(), 120)).decode()
        if not line:
            raise RuntimeError(f"{name} exited before it listened")
        if "listening on" in line:
            return line.split("listening on", 1)[1].strip()


async def stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 20)
        except TimeoutError:
            process.kill()
            await process.wait()


async def start_litellm(engine_url: str, work_dir: Path) -> tuple[asyncio.subprocess.Process, str]:
    config = work_dir / "litellm.yaml"
    config.write_text(
        "model_list:\n  - model_name: tiny\n    litellm_params:\n"
        f"      model: openai/tiny\n      api_base: {engine_url}/v1\n      api_key: none\n"
        "litellm_settings:\n  drop_params: true\n"
        f"general_settings:\n  master_key: {LITELLM_KEY}\n")
    port = free_port()
    litellm = Path(sys.executable).parent / "litellm"
    log = open(work_dir / "litellm.log", "wb")  # noqa: SIM115 (closed with the process)
    process = await asyncio.create_subprocess_exec(
        str(litellm), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
        stdout=log, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"})
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(600):
            if process.returncode is not None:
                raise RuntimeError(f"litellm exited; see {work_dir / 'litellm.log'}")
            try:
                async with http.get(url + "/health/liveliness") as reply:
                    if reply.status == 200:
                        return process, url
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError("litellm's proxy did not start within 300 s")


async def post(http: aiohttp.ClientSession, url: str, body: dict,
               headers: dict | None = None) -> dict:
    async with http.post(url, json=body, headers=headers) as reply:
        payload = await reply.json(content_type=None)
        if reply.status not in (200, 201):
            raise RuntimeError(f"{url} answered {reply.status}: {payload}")
        return payload


async def post_read(http: aiohttp.ClientSession, url: str, body: dict) -> None:
    """POST and read the whole reply (a JSON body, or an SSE stream to its end)."""
    async with http.post(url, json=body) as reply:
        await reply.read()
        if reply.status != 200:
            raise RuntimeError(f"{url} answered {reply.status}")


async def open_session(http, gateway_url: str, group: str) -> dict:
    return await post(http, gateway_url + "/admin/sessions", {"group": group},
                      {"Authorization": f"Bearer {ADMIN_TOKEN}"})

