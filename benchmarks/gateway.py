"""Gateway benchmark: what the gateway costs, side by side in one run.

    python -m benchmarks.gateway [--num-calls 200] [--skip-litellm]

(a) Added latency per call. One built-in engine (tiny model) and, in front of it, the gateway
    (`undertow gateway serve`, a subprocess) and LiteLLM's own proxy server (`litellm --config`,
    a subprocess, forwarding to the engine's `/v1/chat/completions` as `openai/<name>`). The
    same request (one short user message, `max_tokens` 2, greedy) goes, in rotating order, to:
    the engine's `/generate` with the rendered prompt IDs (what the gateway sends), the engine's
    `/v1/chat/completions`, the gateway (a new session per call, so every call renders its
    prompt; once with the default `--store-sync fsync`, whose fsync per call is most of its
    added latency on a slow disk, and once with `flush`), and LiteLLM's proxy. Calls are
    sequential. Added latency = path - baseline: the gateway against `/generate`, LiteLLM
    against the engine's `/v1/chat/completions` (each proxy against the endpoint it forwards
    to); both baselines are reported.
(b) Gateway CPU per call as a session's history grows: for each history size H (1k ... 128k
    tokens, made of 1k-token user turns and short assistant turns, sent once and rendered in
    full), `NUM_CPU_CALLS` calls each add the returned assistant message and a ~64-token user
    message (token truth). The gateway's process CPU time (utime + stime of all its threads,
    /proc/PID/stat) over those calls / their number. The tiny model's context is 40,960, so
    this part runs against the scripted engine of the gateway tests (a real HTTP server
    speaking SGLang's `/generate`, replaying a fixed completion), with the gateway's context
    limit raised; engine time is not gateway CPU, so this measures the same thing.
(c) Storage of a 50-turn session (~200-token user turns, 24 sampled tokens per reply) through
    the gateway to the built-in engine: bytes of the store's file against a per-call log
    (JSON lines with each call's prompt IDs and completion IDs; and with logprobs too).

Writes `benchmarks/results/gateway.json` and prints a Markdown table. The machine is shared:
compare numbers within one run.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.gateway.scripted_engine import ScriptedEngine
from undertow.gateway.engines.launch import launch_engine
from undertow.gateway.render import Renderer
from undertow.gateway.store import TreeStore

RESULTS = Path(__file__).parent / "results" / "gateway.json"
ADMIN_TOKEN = "bench-admin-token"
LITELLM_KEY = "sk-bench-" + "0123456789abcdef" * 4  # the proxy refuses to start without one
HISTORY_TOKENS = (1_000, 8_000, 32_000, 128_000)
NUM_CPU_CALLS = 40
NUM_STORAGE_TURNS = 50
TIMEOUT = aiohttp.ClientTimeout(total=600)
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of process `pid`."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def start_gateway(engine_url: str, model_dir: Path, store_dir: Path,
                        context_length: int = 0, store_sync: str = "fsync"
                        ) -> tuple[asyncio.subprocess.Process, str]:
    command = [sys.executable, "-m", "undertow.cli", "gateway", "serve", "--engine", engine_url,
               "--model", str(model_dir), "--store", str(store_dir), "--port", "0",
               "--context-length", str(context_length), "--store-sync", store_sync]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "UNDERTOW_ADMIN_TOKEN": ADMIN_TOKEN})
    while True:
        line = (await asyncio.wait_for(process.stdout.readline(), 120)).decode()
        if not line:
            raise RuntimeError("the gateway exited before it listened")
        if "listening on" in line:
            return process, line.split("listening on", 1)[1].strip()


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


async def open_session(http, gateway_url: str, group: str) -> dict:
    return await post(http, gateway_url + "/admin/sessions", {"group": group},
                      {"Authorization": f"Bearer {ADMIN_TOKEN}"})


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"p50_ms": 1e3 * statistics.median(ordered),
            "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "num_calls": len(ordered)}


async def latency(engine_url: str, model_dir: Path, work_dir: Path, num_calls: int,
                  with_litellm: bool) -> dict:
    """Part (a): per-call latency of each path, and the gateway's CPU per call."""
    renderer = Renderer(model_dir)
    messages = [{"role": "user", "content": "Say hello."}]
    prompt_ids = renderer.encode(renderer.render(messages, add_generation_prompt=True))
    chat = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0.0}
    generate = {"input_ids": prompt_ids, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    gateways = {sync: await start_gateway(engine_url, model_dir, work_dir / f"store-a-{sync}",
                                          store_sync=sync) for sync in ("fsync", "flush")}
    litellm = None
    try:
        litellm = await start_litellm(engine_url, work_dir) if with_litellm else None
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            sessions = {sync: [await open_session(http, url, "latency")
                               for _ in range(num_calls + 10)]
                        for sync, (_, url) in gateways.items()}

            def gateway_call(sync):
                def call(i):
                    session = sessions[sync][i]
                    key = {"Authorization": f"Bearer {session['api_key']}"}
                    return post(http, session["base_url"] + "/chat/completions", chat, key)
                return call

            paths = {"engine /generate": lambda i: post(http, engine_url + "/generate", generate),
                     "engine /v1/chat/completions":
                         lambda i: post(http, engine_url + "/v1/chat/completions", chat),
                     "gateway": gateway_call("fsync"),
                     "gateway (store-sync flush)": gateway_call("flush")}
            if litellm:
                paths["litellm proxy"] = lambda i: post(
                    http, litellm[1] + "/v1/chat/completions", chat,
                    {"Authorization": f"Bearer {LITELLM_KEY}"})
            seconds = {name: [] for name in paths}
            gateway_cpu_s = 0.0
            for i in range(num_calls + 10):
                names = list(paths)
                for name in names[i % len(names):] + names[:i % len(names)]:
                    cpu_before = cpu_seconds(gateways["fsync"][0].pid)
                    started = time.perf_counter()
                    await paths[name](i)
                    elapsed = time.perf_counter() - started
                    if i >= 10:
                        seconds[name].append(elapsed)
                        if name == "gateway":
                            gateway_cpu_s += cpu_seconds(gateways["fsync"][0].pid) - cpu_before
    finally:
        for process, _ in gateways.values():
            await stop(process)
        if litellm:
            await stop(litellm[0])
    result = {name: percentiles(values) for name, values in seconds.items()}
    result["gateway"]["cpu_ms_per_call"] = 1e3 * gateway_cpu_s / num_calls
    return result


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


async def cpu_by_history(model_dir: Path, work_dir: Path) -> list[dict]:
    """Part (b): gateway CPU per token-truth call at each history size."""
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
    rows = []
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            for num_tokens in HISTORY_TOKENS:
                session = await open_session(http, gateway_url, f"history-{num_tokens}")
                url = session["base_url"] + "/chat/completions"
                key = {"Authorization": f"Bearer {session['api_key']}"}
                messages = history_messages(num_tokens, renderer)
                reply = await post(http, url, {"model": "tiny", "messages": messages,
                                               "max_tokens": 16}, key)
                cpu_s, wall_s, num_prompt = 0.0, 0.0, []
                for i in range(NUM_CPU_CALLS + 3):
                    messages = messages + [reply["choices"][0]["message"], {
                        "role": "user", "content": text_of(64, renderer, 50_000 + i)}]
                    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 16})
                    cpu_before, started = cpu_seconds(gateway.pid), time.perf_counter()
                    async with http.post(url, data=body, headers={
                            **key, "Content-Type": "application/json"}) as answer:
                        reply = await answer.json()
                    if i >= 3:
                        wall_s += time.perf_counter() - started
                        cpu_s += cpu_seconds(gateway.pid) - cpu_before
                        num_prompt.append(reply["usage"]["prompt_tokens"])
                rows.append({"history_tokens": num_tokens,
                             "prompt_tokens_measured": [min(num_prompt), max(num_prompt)],
                             "num_messages": len(messages),
                             "request_bytes": len(body),
                             "cpu_ms_per_call": 1e3 * cpu_s / NUM_CPU_CALLS,
                             "wall_ms_per_call": 1e3 * wall_s / NUM_CPU_CALLS})
                print(f"  history {num_tokens}: {rows[-1]}", flush=True)
    finally:
        await stop(gateway)
        await runner.cleanup()
    return rows


async def storage(engine_url: str, model_dir: Path, work_dir: Path) -> dict:
    """Part (c): a 50-turn session through the gateway; its store file vs a per-call log."""
    renderer = Renderer(model_dir)
    store_dir = work_dir / "store-c"
    gateway, gateway_url = await start_gateway(engine_url, model_dir, store_dir)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            session = await open_session(http, gateway_url, "storage")
            url = session["base_url"] + "/chat/completions"
            key = {"Authorization": f"Bearer {session['api_key']}"}
            messages = [{"role": "system", "content": "You are a software engineering agent."}]
            for turn in range(NUM_STORAGE_TURNS):
                messages.append({"role": "user", "content": text_of(200, renderer, turn)})
                body = {"model": "tiny", "messages": messages, "max_tokens": 24,
                        "temperature": 1.0, "seed": turn}
                reply = await post(http, url, body, key)
                messages.append(reply["choices"][0]["message"])
    finally:
        await stop(gateway)
    store = TreeStore(store_dir, create=False)
    list(store.replay(repair=False))
    tree = store.trees["storage"]
    ids_log, full_log = [], []
    for call in tree.calls:
        logprobs = [lp for node_id in tree.path(call.leaf) for lp in tree.nodes[node_id].logprobs]
        token_ids = tree.path_token_ids(call.leaf)
        cut = len(token_ids) - call.num_completion_tokens
        line = {"prompt_ids": token_ids[:cut], "completion_ids": token_ids[cut:]}
        ids_log.append(json.dumps(line, separators=(",", ":")))
        full_log.append(json.dumps({**line, "logprobs": logprobs[cut:]}, separators=(",", ":")))
    store_bytes = (store_dir / "storage.jsonl").stat().st_size
    ids_bytes = sum(len(line) + 1 for line in ids_log)
    full_bytes = sum(len(line) + 1 for line in full_log)
    return {"num_turns": NUM_STORAGE_TURNS, "num_calls": len(tree.calls),
            "unique_tokens": tree.num_unique_tokens, "per_call_tokens": tree.num_flat_tokens,
            "store_bytes": store_bytes, "per_call_log_bytes": ids_bytes,
            "per_call_log_with_logprobs_bytes": full_bytes,
            "ratio_vs_ids_log": ids_bytes / store_bytes,
            "ratio_vs_log_with_logprobs": full_bytes / store_bytes}


def summarise(report: dict) -> dict:
    lat, cpu = report["latency"], report["cpu_by_history"]
    gateway_ms = lat["gateway"]["p50_ms"] - lat["engine /generate"]["p50_ms"]
    flush_ms = lat["gateway (store-sync flush)"]["p50_ms"] - lat["engine /generate"]["p50_ms"]
    summary = {"gateway_added_p50_ms": gateway_ms, "gateway_flush_added_p50_ms": flush_ms,
               "gateway_added_p99_ms": lat["gateway"]["p99_ms"] - lat["engine /generate"]["p99_ms"],
               "gateway_added_p50_vs_openai_endpoint_ms":
                   lat["gateway"]["p50_ms"] - lat["engine /v1/chat/completions"]["p50_ms"]}
    if "litellm proxy" in lat:
        litellm_ms = (lat["litellm proxy"]["p50_ms"]
                      - lat["engine /v1/chat/completions"]["p50_ms"])
        summary.update(litellm_added_p50_ms=litellm_ms, litellm_added_p99_ms=(
            lat["litellm proxy"]["p99_ms"] - lat["engine /v1/chat/completions"]["p99_ms"]),
            litellm_over_gateway_added=litellm_ms / max(gateway_ms, 1e-3))
    summary["cpu_128k_over_1k"] = cpu[-1]["cpu_ms_per_call"] / cpu[0]["cpu_ms_per_call"]
    summary["storage_ratio"] = report["storage"]["ratio_vs_ids_log"]
    summary["targets"] = {
        "added_p50_le_2ms": gateway_ms <= 2.0,
        "added_p50_le_2ms_store_sync_flush": flush_ms <= 2.0,
        "litellm_ge_5x": summary.get("litellm_over_gateway_added", 0) >= 5,
        "cpu_128k_within_2x": summary["cpu_128k_over_1k"] <= 2.0,
        "storage_ge_10x": summary["storage_ratio"] >= 10}
    return summary


def markdown(report: dict) -> str:
    lat, summary = report["latency"], report["summary"]
    lines = ["| path | p50 ms | p99 ms |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} |"
              for name, row in lat.items()]
    lines += ["", "| added latency (p50 / p99) | ms |", "| --- | ---: |",
              f"| gateway - engine /generate | {summary['gateway_added_p50_ms']:.2f} / "
              f"{summary['gateway_added_p99_ms']:.2f} |",
              f"| gateway (store-sync flush) - engine /generate | "
              f"{summary['gateway_flush_added_p50_ms']:.2f} |",
              f"| gateway - engine /v1/chat/completions | "
              f"{summary['gateway_added_p50_vs_openai_endpoint_ms']:.2f} |"]
    if "litellm_added_p50_ms" in summary:
        lines += [f"| LiteLLM proxy - engine /v1/chat/completions | "
                  f"{summary['litellm_added_p50_ms']:.2f} / "
                  f"{summary['litellm_added_p99_ms']:.2f} |",
                  f"| LiteLLM added / gateway added (p50) | "
                  f"{summary['litellm_over_gateway_added']:.1f}x |"]
    lines += [f"| gateway CPU per call | {lat['gateway']['cpu_ms_per_call']:.2f} |", "",
              "| history tokens | messages | request KB | gateway CPU ms/call | wall ms/call |",
              "| ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {row['history_tokens']:,} | {row['num_messages']} | "
              f"{row['request_bytes'] / 1024:.0f} | {row['cpu_ms_per_call']:.2f} | "
              f"{row['wall_ms_per_call']:.2f} |" for row in report["cpu_by_history"]]
    st = report["storage"]
    lines += ["", "| 50-turn session | bytes | tokens |", "| --- | ---: | ---: |",
              f"| tree store | {st['store_bytes']:,} | {st['unique_tokens']:,} |",
              f"| per-call log (ids) | {st['per_call_log_bytes']:,} | {st['per_call_tokens']:,} |",
              f"| per-call log (ids + logprobs) | {st['per_call_log_with_logprobs_bytes']:,} | |",
              f"| ratio (ids log / store) | {st['ratio_vs_ids_log']:.1f}x | |", "",
              "targets: " + ", ".join(f"{k}={'met' if v else 'MISSED'}"
                                      for k, v in summary["targets"].items())]
    return "\n".join(lines)


async def run(work_dir: Path, num_calls: int, with_litellm: bool) -> dict:
    from undertow.learner.modeldir import init_model_dir

    model_dir = init_model_dir(work_dir / "tiny", size="tiny", seed=0)
    report: dict = {}
    print("(b) gateway CPU per call by history size (scripted engine)", flush=True)
    report["cpu_by_history"] = await cpu_by_history(model_dir, work_dir)
    async with launch_engine("builtin", model_dir) as engine:
        print(f"(a) latency, {num_calls} calls per path", flush=True)
        report["latency"] = await latency(engine.url, model_dir, work_dir, num_calls,
                                          with_litellm)
        print("(c) storage of a 50-turn session", flush=True)
        report["storage"] = await storage(engine.url, model_dir, work_dir)
    report["summary"] = summarise(report)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-calls", type=int, default=200)
    parser.add_argument("--skip-litellm", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="undertow-bench-gateway-") as work_dir:
        report = asyncio.run(run(Path(work_dir), args.num_calls, not args.skip_litellm))
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                         "load_average": os.getloadavg()}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
