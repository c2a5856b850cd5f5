"""Part (a) of `benchmarks.xlong`: one session of 500 calls and about a million tokens at
the gateway, with its history condensed about every 95k tokens.

A scripted scaffold (this process, aiohttp) drives the gateway (`undertow gateway serve`,
a subprocess, so its CPU and memory are its own) in front of the scripted engine (a
real SGLang-protocol server replaying a distinct ~120-token completion per call; the
engine's own speed is not what is measured). Call 1 sends a system prompt and a
2,000-token task; each later call sends the history back with the gateway's reply and
a new ~1,900-token observation, as an agent does. At the start of each cycle of 44-45
calls (about 95k tokens of context) the scaffold condenses: the history becomes the
system prompt, the task and a new 2,000-token summary, which the gateway records as a
`rewrite` branch. Cycles start at calls 1, 46, 91, ..., 491, so calls 10, 100 and 500
are each the 10th call of their cycle and send the same amount of context: any
difference in their cost comes from what the session has accumulated, not from the
request.

Measured: the gateway's CPU (schedstat, all threads) and wall time per call, RSS
(VmRSS) and the store's bytes on disk every 10 calls, and the tree's unique tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from benchmarks.gateway_history import WORDS
from benchmarks.proxies import ADMIN_TOKEN, TIMEOUT, cpu_ns, open_session, start_gateway, stop
from undertow.gateway.engines.scripted import ScriptedEngine
from undertow.gateway.render import Renderer

NUM_CALLS = 500
CYCLE_LENGTHS = [45, 45] + [44] * 5 + [45] * 4 + [45]   # cycles start at 1, 46, 91, ..., 491
TASK_TOKENS = 2000
OBSERVATION_TOKENS = 1900
COMPLETION_TOKENS = 120
SAMPLE_EVERY = 10
REPORTED_CALLS = (10, 100, 500)
WINDOW = 5   # calls k-4..k: the same cycle offsets for each reported call


class Texts:
    """Word text of a given token count, calibrated once on the model's tokenizer."""

    def __init__(self, renderer: Renderer):
        self.renderer = renderer
        sample = self._words(random.Random(-1), 4000)
        self.tokens_per_word = len(renderer.encode(" ".join(sample))) / len(sample)

    @staticmethod
    def _words(rng: random.Random, num: int) -> list[str]:
        return [rng.choice(WORDS) + (str(rng.randrange(1000)) if rng.random() < 0.3 else "")
                for _ in range(num)]

    def text(self, num_tokens: int, seed: int) -> str:
        num_words = max(1, int(num_tokens / self.tokens_per_word))
        return " ".join(self._words(random.Random(seed), num_words))


def cycle_starts() -> set[int]:
    starts, call = set(), 1
    for length in CYCLE_LENGTHS:
        starts.add(call)
        call += length
    return starts


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def store_bytes(store_dir: Path) -> int:
    return sum(path.stat().st_size for path in store_dir.rglob("*") if path.is_file())


async def unique_tokens(http: aiohttp.ClientSession, gateway_url: str, group: str) -> int:
    async with http.get(gateway_url + "/admin/groups",
                        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as reply:
        groups = (await reply.json())["groups"]
    return next(g["num_unique_tokens"] for g in groups if g["group"] == group)


class Scaffold:
    """The scripted agent: grows its history, condenses it at each cycle start."""

    def __init__(self, texts: Texts, session: dict):
        self.texts = texts
        self.url = session["base_url"] + "/chat/completions"
        self.headers = {"Authorization": f"Bearer {session['api_key']}",
                        "Content-Type": "application/json"}
        self.head = [{"role": "system", "content": "You are a software engineering agent."},
                     {"role": "user", "content": texts.text(TASK_TOKENS, 0)}]
        self.messages = list(self.head)
        self.reply: dict | None = None

    def next_body(self, call: int, starts: set[int]) -> bytes:
        if call > 1 and call in starts:
            summary = "Summary of the work so far: " + self.texts.text(TASK_TOKENS, -call)
            self.messages = self.head + [{"role": "user", "content": summary}]
        elif call > 1:
            self.messages = self.messages + [
                self.reply["choices"][0]["message"],
                {"role": "user", "content": self.texts.text(OBSERVATION_TOKENS, call)}]
        return json.dumps({"model": "tiny", "messages": self.messages,
                           "max_tokens": 4 * COMPLETION_TOKENS}).encode()

    async def call(self, http: aiohttp.ClientSession, body: bytes) -> None:
        async with http.post(self.url, data=body, headers=self.headers) as answer:
            self.reply = await answer.json()
            if answer.status != 200:
                raise RuntimeError(f"the gateway answered {answer.status}: {self.reply}")


def completions(renderer: Renderer, texts: Texts, stop_id: int) -> list[list[int]]:
    """One distinct completion per call, each ending with the stop token."""
    return [renderer.encode(texts.text(COMPLETION_TOKENS, 10**6 + call)) + [stop_id]
            for call in range(NUM_CALLS + 1)]


async def run_session(model_dir: Path, work_dir: Path, num_calls: int = NUM_CALLS) -> dict:
    """Part (a): returns per-call rows, samples over the session and a summary."""
    renderer = Renderer(model_dir)
    texts = Texts(renderer)
    stop_id = renderer.tokenizer.token_to_id("<|im_end|>")
    engine = ScriptedEngine(default=[stop_id], stop_token_ids=(stop_id,),
                            scripts=completions(renderer, texts, stop_id))
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    store_dir = work_dir / "store-xlong"
    gateway, gateway_url = await start_gateway(engine_url, model_dir, store_dir,
                                               context_length=2**18)
    calls, samples = [], []
    starts = cycle_starts()
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            session = await open_session(http, gateway_url, "xlong")
            scaffold = Scaffold(texts, session)
            samples.append(_sample(0, gateway.pid, store_dir, 0))
            for call in range(1, num_calls + 1):
                body = scaffold.next_body(call, starts)
                cpu_before, started = cpu_ns(gateway.pid), time.perf_counter()
                await scaffold.call(http, body)
                wall_s = time.perf_counter() - started
                await asyncio.sleep(0.01)   # the reply's last bookkeeping, off the client's clock
                calls.append({"call": call, "cpu_ms": (cpu_ns(gateway.pid) - cpu_before) / 1e6,
                              "wall_ms": 1e3 * wall_s, "request_bytes": len(body),
                              "prompt_tokens": scaffold.reply["usage"]["prompt_tokens"],
                              "condensed": call > 1 and call in starts})
                if call % SAMPLE_EVERY == 0:
                    samples.append(_sample(call, gateway.pid, store_dir,
                                           await unique_tokens(http, gateway_url, "xlong")))
                    print(f"  call {call}: {calls[-1]} {samples[-1]}", flush=True)
    finally:
        await stop(gateway)
        await runner.cleanup()
    return {"calls": calls, "samples": samples, "summary": summarize(calls, samples)}


def _sample(call: int, pid: int, store_dir: Path, num_unique: int) -> dict:
    return {"call": call, "rss_bytes": rss_bytes(pid), "store_bytes": store_bytes(store_dir),
            "unique_tokens": num_unique}


def summarize(calls: list[dict], samples: list[dict]) -> dict:
    """Per-call cost at the reported calls (each alone, and the median of calls k-4..k,
    which sit at the same cycle offsets), and growth of RSS and store against unique
    tokens between the first sample after call 10 and the last."""
    at = {}
    for k in (k for k in REPORTED_CALLS if k <= len(calls)):
        window = calls[k - WINDOW:k]
        at[k] = {"cpu_ms": calls[k - 1]["cpu_ms"], "wall_ms": calls[k - 1]["wall_ms"],
                 "prompt_tokens": calls[k - 1]["prompt_tokens"],
                 "cpu_ms_window_p50": statistics.median(c["cpu_ms"] for c in window),
                 "wall_ms_window_p50": statistics.median(c["wall_ms"] for c in window)}
    last_k = max(at)
    first, last = samples[1], samples[-1]
    unique_growth = last["unique_tokens"] - first["unique_tokens"]
    return {
        "at_call": at,
        "cpu_ratio_500_vs_10": at[last_k]["cpu_ms_window_p50"] / at[10]["cpu_ms_window_p50"],
        "wall_ratio_500_vs_10": at[last_k]["wall_ms_window_p50"] / at[10]["wall_ms_window_p50"],
        "num_calls": len(calls),
        "num_condensations": sum(c["condensed"] for c in calls),
        "total_prompt_tokens": sum(c["prompt_tokens"] for c in calls),
        "max_prompt_tokens": max(c["prompt_tokens"] for c in calls),
        "unique_tokens": last["unique_tokens"],
        "rss_bytes_first": first["rss_bytes"], "rss_bytes_last": last["rss_bytes"],
        "rss_bytes_per_unique_token": (last["rss_bytes"] - first["rss_bytes"]) / unique_growth,
        "store_bytes": last["store_bytes"],
        "store_bytes_per_unique_token": last["store_bytes"] / last["unique_tokens"],
    }
