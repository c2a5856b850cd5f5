"""Part (b) of the gateway benchmark: gateway CPU per call as a session's history grows.

See (b) in `benchmarks.gateway`'s docstring for the method.
"""

import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from benchmarks.proxies import TIMEOUT, cpu_ns, open_session, start_gateway, stop
from tests.gateway.scripted_engine import ScriptedEngine
from undertow.gateway.render import Renderer

HISTORY_TOKENS = (1_000, 8_000, 32_000, 128_000)
NUM_CPU_CALLS = 60
SETTLE_S = 0.02
WORDS = random.Random(0).sample(
    ["file", "test", "error", "line", "return", "value", "import", "class", "patch", "diff",
     "self", "assert", "path", "config", "module", "python", "output", "trace", "failed",
     "passed", "function", "result", "string", "number", "index", "list", "dict", "read",
     "write", "open", "close", "commit", "branch", "merge", "build", "check", "debug"], 37)


def text_of(num_tokens: int, renderer: Renderer, seed: int) -> str:
    """Words whose encoding is about `num_tokens` tokens."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) + (str(rng.randrange(100)) if rng.random() < 0.3 else "")
             for _ in range(num_tokens)]
    text = " ".join(words)
    ratio = num_tokens / max(1, len(renderer.encode(text)))
    return " ".join(words[:max(1, int(len(words) * ratio))])


def history_messages(num_tokens: int, renderer: Renderer) -> list[dict]:
    """A conversation of about `num_tokens` tokens: 1k-token user turns, short replies."""
    messages = [{"role": "system", "content": "You are a software engineering agent."}]
    turn = 0
    while len(renderer.encode(renderer.render(messages))) < num_tokens - 1000:
        messages += [{"role": "user", "content": text_of(1000, renderer, turn)},
                     {"role": "assistant", "content": text_of(30, renderer, 10_000 + turn)}]
        turn += 1
    messages.append({"role": "user", "content": text_of(
        max(50, num_tokens - len(renderer.encode(renderer.render(messages)))), renderer, -1)})
    return messages


class HistorySession:
    """One growing conversation at the gateway, for part (b)."""

    def __init__(self, http, session: dict, messages: list[dict]):
        self.http, self.messages = http, messages
        self.url = session["base_url"] + "/chat/completions"
        self.headers = {"Authorization": f"Bearer {session['api_key']}",
                        "Content-Type": "application/json"}
        self.reply: dict | None = None
        self.cpu_ms: list[float] = []
        self.wall_ms: list[float] = []
        self.prompt_tokens: list[int] = []
        self.request_bytes = 0

    def next_body(self, renderer: Renderer, seed: int) -> bytes:
        if self.reply is not None:
            self.messages = self.messages + [self.reply["choices"][0]["message"], {
                "role": "user", "content": text_of(64, renderer, seed)}]
        body = json.dumps({"model": "tiny", "messages": self.messages, "max_tokens": 16})
        self.request_bytes = len(body)
        return body.encode()

    async def call(self, body: bytes, pid: int, measure: bool) -> None:
        cpu_before, started = cpu_ns(pid), time.perf_counter()
        async with self.http.post(self.url, data=body, headers=self.headers) as answer:
            self.reply = await answer.json()
            if answer.status != 200:
                raise RuntimeError(f"the gateway answered {answer.status}: {self.reply}")
        wall_s = time.perf_counter() - started
        await asyncio.sleep(SETTLE_S)
        if measure:
            self.cpu_ms.append((cpu_ns(pid) - cpu_before) / 1e6)
            self.wall_ms.append(1e3 * wall_s)
            self.prompt_tokens.append(self.reply["usage"]["prompt_tokens"])


async def cpu_by_history(model_dir: Path, work_dir: Path) -> list[dict]:
    """Part (b): gateway CPU per token-truth call at each history size, sizes interleaved."""
    renderer = Renderer(model_dir)
    im_end = renderer.tokenizer.token_to_id("<|im_end|>")
    engine = ScriptedEngine(default=renderer.encode("Done; next step.") + [im_end],
                            stop_token_ids=(im_end,))
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    gateway, gateway_url = await start_gateway(engine_url, model_dir, work_dir / "store-b",
                                               context_length=2**18)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            sessions = [HistorySession(http, await open_session(http, gateway_url, f"h{n}"),
                                       history_messages(n, renderer))
                        for n in HISTORY_TOKENS]
            for session in sessions:  # the first call renders the history in full
                await session.call(session.next_body(renderer, 0), gateway.pid, False)
            for i in range(NUM_CPU_CALLS + 3):
                for session in sessions if i % 2 == 0 else sessions[::-1]:
                    body = session.next_body(renderer, 50_000 + i)
                    await session.call(body, gateway.pid, measure=i >= 3)
    finally:
        await stop(gateway)
        await runner.cleanup()
    rows = []
    for num_tokens, session in zip(HISTORY_TOKENS, sessions, strict=True):
        rows.append({"history_tokens": num_tokens,
                     "prompt_tokens_measured": [min(session.prompt_tokens),
                                                max(session.prompt_tokens)],
                     "num_messages": len(session.messages),
                     "request_bytes": session.request_bytes,
                     "cpu_ms_per_call_p50": statistics.median(session.cpu_ms),
                     "cpu_ms_per_call_mean": statistics.fmean(session.cpu_ms),
                     "wall_ms_per_call_p50": statistics.median(session.wall_ms),
                     "num_calls": len(session.cpu_ms)})
        print(f"  history {num_tokens}: {rows[-1]}", flush=True)
    return rows

