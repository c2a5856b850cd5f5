"""Part (d) of `benchmarks.xlong`: one session that re-sends its whole, never condensed,
history on every call, up to about a million tokens, at the gateway and at a bare relay.

A scripted scaffold (this process, aiohttp) runs one tool-calling session: call 1 sends a
system prompt, a `bash` tool and a 2,000-token task; each later call sends the history
back with the gateway's reply (a Hermes tool call of about 100 tokens) and a tool result
of about 1,900 tokens, so the prompt grows by about 2,000 tokens a call (1M at call 500).
Every request body, byte for byte, also goes to a bare relay (`benchmarks/bare_relay.py`:
aiohttp, orjson and the gateway's HTTP client, nothing else), the two in turn (which goes
first alternates), each in front of its own scripted engine answering at once. So the
relay's CPU per call is what any proxy pays to take in a history of that size, measured
in the same run beside the gateway's, and their difference is the gateway's own work.

Measured per call: the CPU of each process (schedstat, all threads) from just before
its request to `SETTLE_S` after its reply, and its wall time; the gateway's RSS and the
load average every `SAMPLE_EVERY` calls; and token truth: each prompt the gateway sent its
engine begins with the previous prompt and the IDs sampled for it. Targets (issue 30): at
the last `WINDOW` calls the gateway's CPU per call at most 1.2x the relay's (p50s), and the
gateway's own work (its CPU minus the relay's, call by call) there within 1.5x of its
work in calls `OWN_WORK_START` .. `OWN_WORK_START + WINDOW - 1`.

What the two do differently, for reading the ratio: the relay parses every body whole
(orjson) and sends its engine a fixed ~2,000-token prompt; the gateway parses only what a
body adds (`gateway/front/api/resent_body.py`), tokenizes the new observation, sends its engine
the whole history's IDs (3.8 MB of JSON at 1M tokens), detokenizes and parses the ~116
streamed tokens of each reply, and records the call (tree, write-ahead log, heads).
`costs` measures, in this process after the run, what of that can be timed apart on the
last call: parsing its body whole and where it is new, tokenizing its observation and
sending its prompt's IDs; with the own work of the early calls (all of it O(new tokens))
and its growth to the end they bound the ratio (README, xLong (d)).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from benchmarks.proxies import (
    TIMEOUT,
    cpu_ns,
    open_session,
    start_bare_relay,
    start_gateway,
    stop,
)
from benchmarks.xlong_session import Texts, rss_bytes
from undertow.gateway.engines.scripted import ScriptedEngine
from undertow.gateway.front.api.resent_body import parse_resent
from undertow.gateway.render import Renderer

NUM_CALLS = 500
TASK_TOKENS = 2000
TOOL_RESULT_TOKENS = 1900
COMMAND_TOKENS = 100
SAMPLE_EVERY = 50
SETTLE_S = 0.01
NUM_REPEATS = 7  # of each cost measured in `costs`
WINDOW = 20
OWN_WORK_START = 11  # calls 11-30: the "from call 20" window, past the first calls' warm-up
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the repository",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]


class LastPromptEngine(ScriptedEngine):
    """The scripted engine, keeping only its last request (`ScriptedEngine.sent` keeps
    every prompt: 250M IDs over a million-token session)."""

    async def generate(self, request: web.Request) -> web.StreamResponse:
        response = await super().generate(request)
        *earlier, last = self.sent
        for rid in earlier:
            del self.sent[rid]
        self.last = self.sent[last]
        return response


async def start_engine(scripts: list[list[int]], stop_id: int
                       ) -> tuple[LastPromptEngine, web.AppRunner, str]:
    engine = LastPromptEngine(default=[stop_id], stop_token_ids=(stop_id,),
                              scripts=[list(s) for s in scripts], max_body_bytes=2**28)
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return engine, runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def tool_call_completions(renderer: Renderer, texts: Texts, stop_id: int, num_calls: int,
                          command_tokens: int = COMMAND_TOKENS) -> list[list[int]]:
    """One distinct Hermes tool call per call, ending with the stop token."""
    return [renderer.encode('<tool_call>\n{"name": "bash", "arguments": {"command": "'
                            + texts.text(command_tokens, 10**6 + call) + '"}}\n</tool_call>')
            + [stop_id] for call in range(num_calls + 1)]


class GrowingScaffold:
    """The scripted agent: its history only grows (no condensation)."""

    def __init__(self, texts: Texts, command_tokens: int = COMMAND_TOKENS):
        self.texts, self.command_tokens = texts, command_tokens
        self.messages = [{"role": "system", "content": "You are a software engineering agent."},
                         {"role": "user", "content": texts.text(TASK_TOKENS, 0)}]

    def next_body(self, call: int, reply: dict | None) -> bytes:
        if reply is not None:
            message = reply["choices"][0]["message"]
            self.messages += [message, {"role": "tool",
                                        "tool_call_id": message["tool_calls"][0]["id"],
                                        "content": self.texts.text(TOOL_RESULT_TOKENS, call)}]
        return json.dumps({"model": "tiny", "messages": self.messages, "tools": TOOLS,
                           "max_tokens": 4 * self.command_tokens}).encode()


class Proxy:
    """One proxy under measurement: its process, its chat URL and key, its engine."""

    def __init__(self, process, session: dict, engine: LastPromptEngine):
        self.process, self.engine = process, engine
        self.url = session["base_url"] + "/chat/completions"
        self.headers = {"Authorization": f"Bearer {session['api_key']}",
                        "Content-Type": "application/json"}

    async def call(self, http: aiohttp.ClientSession, body: bytes) -> tuple[dict, dict]:
        """The reply, and the call's CPU ms and wall ms at this proxy."""
        cpu_before, started = cpu_ns(self.process.pid), time.perf_counter()
        async with http.post(self.url, data=body, headers=self.headers) as answer:
            reply = await answer.json()
            if answer.status != 200:
                raise RuntimeError(f"{self.url} answered {answer.status}: {reply}")
        wall_ms = 1e3 * (time.perf_counter() - started)
        await asyncio.sleep(SETTLE_S)  # the reply's last bookkeeping, off the client's clock
        return reply, {"cpu_ms": (cpu_ns(self.process.pid) - cpu_before) / 1e6,
                       "wall_ms": wall_ms}


async def run_growing(model_dir: Path, work_dir: Path, num_calls: int = NUM_CALLS,
                      command_tokens: int = COMMAND_TOKENS) -> dict:
    """Part (d): per-call rows, RSS samples and a summary (see the module docstring).
    `command_tokens` sets the length of each reply's command (the streamed tokens of a
    reply are about 25 more)."""
    renderer = Renderer(model_dir)
    texts = Texts(renderer)
    stop_id = renderer.tokenizer.token_to_id("<|im_end|>")
    scripts = tool_call_completions(renderer, texts, stop_id, num_calls, command_tokens)
    first_prompt = renderer.encode(renderer.render(GrowingScaffold(texts).messages, TOOLS,
                                                   add_generation_prompt=True))
    gateway_engine, gateway_runner, gateway_engine_url = await start_engine(scripts, stop_id)
    relay_engine, relay_runner, relay_engine_url = await start_engine(scripts, stop_id)
    gateway, gateway_url = await start_gateway(gateway_engine_url, model_dir,
                                               work_dir / "store-xlong-growing",
                                               context_length=2**21)
    relay = None
    try:
        relay, relay_url = await start_bare_relay(relay_engine_url, first_prompt)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            proxies = {"gateway": Proxy(gateway, await open_session(http, gateway_url, "xg"),
                                        gateway_engine),
                       "relay": Proxy(relay, await open_session(http, relay_url, "xg"),
                                      relay_engine)}
            scaffold = GrowingScaffold(texts, command_tokens)
            calls, samples, bodies = await drive(http, proxies, scaffold, num_calls)
    finally:
        await stop(gateway)
        if relay is not None:
            await stop(relay)
        await gateway_runner.cleanup()
        await relay_runner.cleanup()
    prompt_json = orjson.dumps(gateway_engine.last.input_ids)
    return {"calls": calls, "samples": samples,
            "summary": summarize(calls, samples,
                                 costs(renderer, scaffold, bodies, prompt_json))}


def costs(renderer: Renderer, scaffold: GrowingScaffold, bodies: list[bytes],
          prompt_json: bytes) -> dict:
    """CPU ms (p50 of `NUM_REPEATS`, this process) of parsing the last body whole (what the
    relay does) and where it is new after the two before it (the gateway), of tokenizing
    its observation, and of sending the last prompt's IDs (`prompt_json`) over loopback
    TCP to another process (both only the gateway)."""
    _, known = parse_resent(bodies[-3], None)
    _, known = parse_resent(bodies[-2], known)  # proves where the history ends

    def cpu_ms(work) -> float:
        times = []
        for _ in range(NUM_REPEATS):
            started = time.process_time()
            work()
            times.append(1e3 * (time.process_time() - started))
        return statistics.median(times)

    observation = scaffold.messages[-1]["content"]
    spliced, _ = parse_resent(bodies[-1], known)
    assert spliced == orjson.loads(bodies[-1])
    return {"body_bytes": len(bodies[-1]),
            "parse_whole_ms": cpu_ms(lambda: orjson.loads(bodies[-1])),
            "parse_new_ms": cpu_ms(lambda: parse_resent(bodies[-1], known)),
            "tokenize_observation_ms": cpu_ms(lambda: renderer.encode(observation)),
            "observation_tokens": len(renderer.encode(observation)),
            "send_prompt_ids_ms": send_cpu_ms(prompt_json)}


READER = """import socket, sys
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
while True:
    num_bytes = 0
    while num_bytes < int(sys.argv[1]):
        data = connection.recv(1 << 20)
        if not data:
            sys.exit(0)
        num_bytes += len(data)
    connection.sendall(b"k")
"""


def send_cpu_ms(payload: bytes) -> float:
    """This process's CPU ms (p50 of `NUM_REPEATS`) to send `payload` over loopback TCP to
    a reader in another process: what the gateway spends to hand an engine its prompt."""
    reader = subprocess.Popen([sys.executable, "-c", READER, str(len(payload))],
                              stdout=subprocess.PIPE)
    try:
        with socket.create_connection(("127.0.0.1", int(reader.stdout.readline()))) as sock:
            times = []
            for _ in range(NUM_REPEATS):
                started = time.process_time()
                sock.sendall(payload)
                sock.recv(1)  # the reader has all of it
                times.append(1e3 * (time.process_time() - started))
    finally:
        reader.kill()
        reader.wait()
    return statistics.median(times)


async def drive(http: aiohttp.ClientSession, proxies: dict[str, Proxy],
                scaffold: GrowingScaffold, num_calls: int
                ) -> tuple[list[dict], list[dict], list[bytes]]:
    """The session's calls, each to both proxies in turn; the gateway's replies drive it.
    Returns the rows, the samples and the last three bodies."""
    calls, samples, reply, previous, bodies = [], [], None, None, []
    gateway = proxies["gateway"]
    for call in range(1, num_calls + 1):
        body = scaffold.next_body(call, reply)
        bodies = [*bodies[-2:], body]
        order = ("gateway", "relay") if call % 2 else ("relay", "gateway")
        row: dict = {"call": call, "request_bytes": len(body)}
        for name in order:
            answer, cost = await proxies[name].call(http, body)
            row.update({f"{name}_{key}": value for key, value in cost.items()})
            if name == "gateway":
                reply = answer
        sent = gateway.engine.last
        row["prompt_tokens"] = len(sent.input_ids)
        row["input_ids_json_bytes"] = len(orjson.dumps(sent.input_ids))
        row["completion_tokens"] = len(sent.output_ids)
        row["token_truth"] = previous is None or (
            sent.input_ids[:len(previous)] == previous)
        previous = sent.input_ids + sent.output_ids
        calls.append(row)
        if call % SAMPLE_EVERY == 0 or call == num_calls:
            samples.append({"call": call, "rss_bytes": rss_bytes(gateway.process.pid),
                            "prompt_tokens": row["prompt_tokens"],
                            "load_average": os.getloadavg()[0]})
            print(f"  call {call}: {row}", flush=True)
    return calls, samples, bodies


def _p50(calls: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in calls)


def summarize(calls: list[dict], samples: list[dict], measured: dict) -> dict:
    """The two windows' p50s, the ratios the targets read, token truth and `costs`."""
    early = calls[OWN_WORK_START - 1:OWN_WORK_START - 1 + WINDOW]
    late = calls[-WINDOW:]
    own = {name: statistics.median(row["gateway_cpu_ms"] - row["relay_cpu_ms"]
                                   for row in window)
           for name, window in (("early", early), ("late", late))}
    first_calls = calls[:WINDOW]
    summary = {
        "num_calls": len(calls), "max_prompt_tokens": max(r["prompt_tokens"] for r in calls),
        "max_request_bytes": max(r["request_bytes"] for r in calls),
        "windows": {"first": [1, len(first_calls)],
                    "early": [OWN_WORK_START, OWN_WORK_START + len(early) - 1],
                    "late": [calls[-len(late)]["call"], calls[-1]["call"]]},
        "num_token_truth": sum(r["token_truth"] for r in calls),
        "gateway_own_cpu_ms_early_p50": own["early"],
        "gateway_own_cpu_ms_late_p50": own["late"],
        "own_cpu_late_over_early": own["late"] / max(own["early"], 1e-3),
        "rss_bytes_per_prompt_token": ((samples[-1]["rss_bytes"] - samples[0]["rss_bytes"])
                                       / max(1, samples[-1]["prompt_tokens"]
                                             - samples[0]["prompt_tokens"])),
        "load_average": [min(s["load_average"] for s in samples),
                         max(s["load_average"] for s in samples)],
        "last_input_ids_json_bytes": calls[-1]["input_ids_json_bytes"],
        "completion_tokens_p50": _p50(calls, "completion_tokens"),
        "costs": measured,
    }
    for name in ("gateway", "relay"):
        for key in ("cpu_ms", "wall_ms"):
            for window_name, window in (("first", first_calls), ("late", late)):
                summary[f"{name}_{key}_{window_name}_p50"] = _p50(window, f"{name}_{key}")
    summary["gateway_cpu_late_over_relay"] = (summary["gateway_cpu_ms_late_p50"]
                                              / summary["relay_cpu_ms_late_p50"])
    summary["gateway_cpu_late_over_first"] = (summary["gateway_cpu_ms_late_p50"]
                                              / summary["gateway_cpu_ms_first_p50"])
    summary["targets"] = {
        "gateway_cpu_le_1_2x_relay_at_end": summary["gateway_cpu_late_over_relay"] <= 1.2,
        "own_work_flat_within_1_5x": summary["own_cpu_late_over_early"] <= 1.5,
        "token_truth_every_call": summary["num_token_truth"] == len(calls)}
    return summary


def growing_table(result: dict) -> str:
    summary = result["summary"]
    lines = ["| calls | prompt tokens | gateway CPU ms p50 | bare relay CPU ms p50 "
             "| gateway - relay ms p50 | gateway wall ms p50 | relay wall ms p50 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    calls = result["calls"]
    starts = [*range(0, len(calls) - WINDOW, max(1, len(calls) // 10)), len(calls) - WINDOW]
    for start in starts:
        window = calls[max(0, start):start + WINDOW]
        lines.append(
            f"| {window[0]['call']}-{window[-1]['call']} | {window[-1]['prompt_tokens']:,} | "
            f"{_p50(window, 'gateway_cpu_ms'):.2f} | {_p50(window, 'relay_cpu_ms'):.2f} | "
            f"{statistics.median(r['gateway_cpu_ms'] - r['relay_cpu_ms'] for r in window):.2f}"
            f" | {_p50(window, 'gateway_wall_ms'):.2f} | {_p50(window, 'relay_wall_ms'):.2f} |")
    late = summary["windows"]["late"]
    lines += ["", f"Calls {late[0]}-{late[1]} (up to {summary['max_prompt_tokens']:,} prompt "
              f"tokens): gateway CPU {summary['gateway_cpu_late_over_relay']:.2f}x the bare "
              f"relay's; the gateway's own work (its CPU minus the relay's) "
              f"{summary['gateway_own_cpu_ms_late_p50']:.2f} ms against "
              f"{summary['gateway_own_cpu_ms_early_p50']:.2f} ms at calls "
              f"{summary['windows']['early'][0]}-{summary['windows']['early'][1]} "
              f"({summary['own_cpu_late_over_early']:.2f}x). Token truth "
              f"{summary['num_token_truth']}/{summary['num_calls']}; gateway RSS growth "
              f"{summary['rss_bytes_per_prompt_token']:.0f} bytes per prompt token; load "
              f"average {summary['load_average'][0]:.1f} to {summary['load_average'][1]:.1f}.",
              "", costs_line(summary), "",
              "targets: " + ", ".join(f"{k}={'met' if v else 'MISSED'}"
                                      for k, v in summary["targets"].items())]
    return "\n".join(lines)


def costs_line(summary: dict) -> str:
    costs = summary["costs"]
    return (f"On the last body ({costs['body_bytes'] / 1e6:.2f} MB), in the benchmark's "
            f"process: parsed whole (the relay) {costs['parse_whole_ms']:.2f} ms, where new "
            f"(the gateway) {costs['parse_new_ms']:.2f} ms; its "
            f"{costs['observation_tokens']:,}-token observation tokenized (the gateway) "
            f"{costs['tokenize_observation_ms']:.2f} ms. The gateway sent its engine "
            f"{summary['last_input_ids_json_bytes'] / 1e6:.2f} MB of prompt IDs on the last "
            f"call (the relay a fixed prompt): {costs['send_prompt_ids_ms']:.2f} ms to send "
            f"over loopback TCP.")
