"""Gateway benchmark: what the gateway costs, side by side in one run.

    python -m benchmarks.gateway [--num-calls 200] [--skip-litellm] [--only-formats]

(a) Added latency per call, measured in pairs. One built-in engine (tiny model) and, in
    front of it, the gateway (`undertow gateway serve`, a subprocess; once with the default
    `store_sync=flush` and once with `fsync`) and LiteLLM's own proxy server (`litellm
    --config`, a subprocess, forwarding to the engine's `/v1/chat/completions` as
    `openai/<name>`). The request: one short user message, `max_tokens` 2, greedy; the
    gateway gets a new session per call, so every call renders its prompt in full. Each
    proxy is paired with the engine endpoint it forwards to: the gateway with `/generate`
    (sent the rendered prompt IDs, as the gateway sends them), LiteLLM with the engine's
    `/v1/chat/completions`. A third gateway pair takes `/generate` with `stream: true`, as
    the gateway itself asks the engine (it streams, so that a generation can resume on
    another engine): a diagnostic of how much of the added time is the engine streaming;
    the headline keeps the non-streamed baseline. A "bare relay (floor)" pair measures the
    floor any gateway on this stack pays (`benchmarks/bare_relay.py`, a subprocess, paired
    with `/generate` as the gateway is): two more loopback hops, aiohttp's server and a
    streamed engine reply read by the gateway's own HTTP client, and nothing else (fixed
    prompt IDs; no session, template, tokenizer, parser or store). The gateway's added
    latency minus the relay's is the cost of the gateway's own logic, and the target: p50
    at most 1.5 ms (`ADDED_OVER_BARE_RELAY_MS`). In each round every
    pair runs its two calls back to back, the direct one first in even rounds and second
    in odd ones, and the pairs take turns in going first. Added latency = the proxied
    call's time - its pair's direct call's time; p50 and p99 of those differences are the
    headline (engine time, ~10-50 ms per call and noisy on a loaded machine, cancels
    within a pair); the difference of the two medians is reported too. Process CPU per
    call of the gateway, the bare relay and LiteLLM's proxy comes from
    /proc/PID/task/*/schedstat (nanoseconds, all threads).
(b) Gateway CPU per call as a session's history grows: for each history size H (1k ... 128k
    tokens, made of 1k-token user turns and short assistant turns, sent once and rendered in
    full), a session whose later calls each add the returned assistant message and a
    ~64-token user message (token truth; so each history grows by ~4.7k tokens over the
    run, and the measured prompt sizes are reported). The sizes take turns call by call in
    one gateway process (default store mode), so load on the machine hits them alike; a
    call's CPU is the gateway's CPU time (schedstat, all threads) from just before its
    request to 20 ms after its reply (work after the reply's last byte belongs to it).
    Median and mean per size; the target compares medians. The tiny model's context is
    40,960, so this part runs against the scripted engine of the gateway tests (a real
    HTTP server speaking SGLang's `/generate`, replaying a fixed completion), with the
    gateway's context limit raised; engine time is not gateway CPU, so this measures the
    same thing.
(c) Storage of a 50-turn session (~200-token user turns, 24 sampled tokens per reply) through
    the gateway to the built-in engine: bytes of the store's file against a per-call log
    (JSON lines with each call's prompt IDs and completion IDs; and with logprobs too).
(d) The latency a reasoning template and a non-Hermes tool-call parser add, against the
    default template and Hermes (`gateway_formats.py`; `--only-formats` runs just this
    part and writes `benchmarks/results/gateway_formats.json`).

Store modes (`store_sync=`): `flush` (default) writes each call's record to the OS before
the reply's last byte (survives the gateway being killed) and fsyncs in the background
within 1 s; `fsync` also waits for the fsync before the last byte (survives a power loss).
The headline figures use the default, `flush`; `fsync` is reported beside it.

Writes `benchmarks/results/gateway.json` and prints a Markdown table. The machine is shared:
compare numbers within one run; the load average is recorded.
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.gateway_formats import format_latency, formats_markdown
from benchmarks.gateway_history import cpu_by_history, text_of
from benchmarks.proxies import (
    LITELLM_KEY,
    TIMEOUT,
    cpu_ns,
    open_session,
    post,
    post_read,
    start_bare_relay,
    start_gateway,
    start_litellm,
    stop,
)
from undertow.gateway.engines.launch import launch_engine
from undertow.gateway.front.store import TreeStore
from undertow.gateway.render import Renderer

RESULTS = Path(__file__).parent / "results" / "gateway.json"
FORMATS_RESULTS = Path(__file__).parent / "results" / "gateway_formats.json"
NUM_WARMUP = 10
NUM_STORAGE_TURNS = 50
STREAMED = "gateway (flush), vs streamed"  # paired with /generate streamed, as the gateway asks
BARE_RELAY = "bare relay (floor)"  # no gateway logic: see (a) in the module docstring
# The added-latency target: the gateway's paired p50 minus the bare relay's, both measured
# in the same run, so that what the machine adds to every proxy on this HTTP stack (an
# absolute 2 ms held on one machine and not another) cancels out.
ADDED_OVER_BARE_RELAY_MS = 1.5


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary_ms(seconds: list[float]) -> dict:
    return {"p50_ms": 1e3 * statistics.median(seconds), "p99_ms": 1e3 * percentile(seconds, 0.99),
            "num_calls": len(seconds)}


async def timed(call) -> float:
    """Seconds until the awaitable `call` (a request not yet sent) is answered."""
    started = time.perf_counter()
    await call
    return time.perf_counter() - started


async def latency(engine_url: str, model_dir: Path, work_dir: Path, num_calls: int,
                  with_litellm: bool) -> dict:
    """Part (a): paired added latency of each proxy against the endpoint it forwards to."""
    renderer = Renderer(model_dir)
    messages = [{"role": "user", "content": "Say hello."}]
    prompt_ids = renderer.encode(renderer.render(messages, add_generation_prompt=True))
    chat = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0.0}
    generate = {"input_ids": prompt_ids, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    gateways = {sync: await start_gateway(engine_url, model_dir, work_dir / f"store-a-{sync}",
                                          store_sync=sync) for sync in ("flush", "fsync")}
    relay = litellm = None
    try:
        relay = await start_bare_relay(engine_url, prompt_ids)
        litellm = await start_litellm(engine_url, work_dir) if with_litellm else None
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            pids = {f"gateway ({sync})": process.pid for sync, (process, _) in gateways.items()}
            pids[STREAMED] = pids["gateway (flush)"]
            pids[BARE_RELAY] = relay[0].pid
            pairs = {}
            for name, url, direct_body in (
                    ("gateway (flush)", gateways["flush"][1], generate),
                    (BARE_RELAY, relay[1], generate),
                    ("gateway (fsync)", gateways["fsync"][1], generate),
                    (STREAMED, gateways["flush"][1], {**generate, "stream": True})):
                sessions = [await open_session(http, url, "latency")
                            for _ in range(num_calls + NUM_WARMUP)]
                pairs[name] = (
                    lambda i, body=direct_body: post_read(http, engine_url + "/generate", body),
                    lambda i, sessions=sessions: post(
                        http, sessions[i]["base_url"] + "/chat/completions", chat,
                        {"Authorization": f"Bearer {sessions[i]['api_key']}"}))
            if litellm:
                pids["litellm proxy"] = litellm[0].pid
                pairs["litellm proxy"] = (
                    lambda i: post(http, engine_url + "/v1/chat/completions", chat),
                    lambda i: post(http, litellm[1] + "/v1/chat/completions", chat,
                                   {"Authorization": f"Bearer {LITELLM_KEY}"}))
            samples = await run_pairs(pairs, pids, num_calls)
    finally:
        for process, _ in gateways.values():
            await stop(process)
        if relay:
            await stop(relay[0])
        if litellm:
            await stop(litellm[0])
    return samples


async def run_pairs(pairs: dict, pids: dict, num_calls: int) -> dict:
    """Rounds of back-to-back (direct, proxied) calls; see (a) in the module docstring."""
    raw = {name: {"direct_s": [], "proxied_s": [], "added_s": [], "cpu_ms": []}
           for name in pairs}
    names = list(pairs)
    for i in range(num_calls + NUM_WARMUP):
        for name in names[i % len(names):] + names[:i % len(names)]:
            direct, proxied = pairs[name]
            cpu_before = cpu_ns(pids[name])
            if i % 2 == 0:
                direct_s = await timed(direct(i))
                proxied_s = await timed(proxied(i))
            else:
                proxied_s = await timed(proxied(i))
                direct_s = await timed(direct(i))
            cpu_ms = (cpu_ns(pids[name]) - cpu_before) / 1e6
            if i >= NUM_WARMUP:
                row = raw[name]
                row["direct_s"].append(direct_s)
                row["proxied_s"].append(proxied_s)
                row["added_s"].append(proxied_s - direct_s)
                row["cpu_ms"].append(cpu_ms)
    result = {}
    for name, row in raw.items():
        added = row["added_s"]
        result[name] = {
            "direct": summary_ms(row["direct_s"]), "proxied": summary_ms(row["proxied_s"]),
            "added_p50_ms": 1e3 * statistics.median(added),
            "added_p99_ms": 1e3 * percentile(added, 0.99),
            "added_mean_ms": 1e3 * statistics.fmean(added),
            "median_difference_ms": 1e3 * (statistics.median(row["proxied_s"])
                                           - statistics.median(row["direct_s"])),
            "cpu_ms_per_call_p50": statistics.median(row["cpu_ms"]),
            "num_pairs": len(added)}
    return result



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
    tree = store.tree("storage")
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
    gateway, fsync, relay = lat["gateway (flush)"], lat["gateway (fsync)"], lat[BARE_RELAY]
    summary = {"store_sync_of_headline": "flush",
               "gateway_added_p50_ms": gateway["added_p50_ms"],
               "gateway_added_p99_ms": gateway["added_p99_ms"],
               "gateway_fsync_added_p50_ms": fsync["added_p50_ms"],
               "gateway_fsync_added_p99_ms": fsync["added_p99_ms"],
               "bare_relay_added_p50_ms": relay["added_p50_ms"],
               "gateway_over_bare_relay_added_ms": gateway["added_p50_ms"]
               - relay["added_p50_ms"],
               "gateway_fsync_over_bare_relay_added_ms": fsync["added_p50_ms"]
               - relay["added_p50_ms"]}
    if "litellm proxy" in lat:
        litellm = lat["litellm proxy"]
        summary.update(litellm_added_p50_ms=litellm["added_p50_ms"],
                       litellm_added_p99_ms=litellm["added_p99_ms"],
                       litellm_over_gateway_added=litellm["added_p50_ms"]
                       / max(gateway["added_p50_ms"], 1e-3),
                       litellm_over_gateway_fsync_added=litellm["added_p50_ms"]
                       / max(fsync["added_p50_ms"], 1e-3))
    summary["cpu_128k_over_1k"] = cpu[-1]["cpu_ms_per_call_p50"] / cpu[0]["cpu_ms_per_call_p50"]
    summary["cpu_128k_over_1k_mean"] = (cpu[-1]["cpu_ms_per_call_mean"]
                                        / cpu[0]["cpu_ms_per_call_mean"])
    summary["storage_ratio"] = report["storage"]["ratio_vs_ids_log"]
    summary["targets"] = {  # the added latency against the floor measured in the same run
        "added_over_bare_relay_p50_le_1_5ms": summary["gateway_over_bare_relay_added_ms"]
        <= ADDED_OVER_BARE_RELAY_MS,
        "added_over_bare_relay_p50_le_1_5ms_store_sync_fsync":
            summary["gateway_fsync_over_bare_relay_added_ms"] <= ADDED_OVER_BARE_RELAY_MS,
        "litellm_ge_5x": summary.get("litellm_over_gateway_added", 0) >= 5,
        "cpu_128k_within_2x": summary["cpu_128k_over_1k"] <= 2.0,
        "storage_ge_10x": summary["storage_ratio"] >= 10}
    return summary


def markdown(report: dict) -> str:
    lat, summary = report["latency"], report["summary"]
    lines = ["| path (paired with) | direct p50 ms | proxied p50 ms | added p50 / p99 ms "
             "(paired) | difference of medians ms | proxy CPU ms/call |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    baselines = {"gateway (flush)": "engine /generate", "gateway (fsync)": "engine /generate",
                 STREAMED: "engine /generate, stream=true", BARE_RELAY: "engine /generate",
                 "litellm proxy": "engine /v1/chat/completions"}
    lines += [f"| {name} ({baselines[name]}) | {row['direct']['p50_ms']:.2f} | "
              f"{row['proxied']['p50_ms']:.2f} | {row['added_p50_ms']:.2f} / "
              f"{row['added_p99_ms']:.2f} | {row['median_difference_ms']:.2f} | "
              f"{row['cpu_ms_per_call_p50']:.2f} |" for name, row in lat.items()]
    lines += ["", f"Gateway added - bare relay added (paired p50s): "
              f"{summary['gateway_over_bare_relay_added_ms']:.2f} ms, the gateway's own logic "
              f"(the relay, the floor of this HTTP stack, adds "
              f"{summary['bare_relay_added_p50_ms']:.2f} ms)."]
    if "litellm_over_gateway_added" in summary:
        lines += ["", f"LiteLLM added / gateway added (paired p50): "
                  f"{summary['litellm_over_gateway_added']:.1f}x with `flush` (default), "
                  f"{summary['litellm_over_gateway_fsync_added']:.1f}x with `fsync`."]
    lines += ["", "| history tokens | prompt tokens measured | messages (last) | request KB "
              "(last) | gateway CPU ms/call p50 | mean | wall ms/call p50 |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {row['history_tokens']:,} | {row['prompt_tokens_measured'][0]:,}-"
              f"{row['prompt_tokens_measured'][1]:,} | {row['num_messages']} | "
              f"{row['request_bytes'] / 1024:.0f} | {row['cpu_ms_per_call_p50']:.2f} | "
              f"{row['cpu_ms_per_call_mean']:.2f} | {row['wall_ms_per_call_p50']:.2f} |"
              for row in report["cpu_by_history"]]
    lines += ["", f"CPU per call at 128k / at 1k: {summary['cpu_128k_over_1k']:.2f}x (medians), "
              f"{summary['cpu_128k_over_1k_mean']:.2f}x (means)."]
    st = report["storage"]
    lines += ["", "| 50-turn session | bytes | tokens |", "| --- | ---: | ---: |",
              f"| tree store | {st['store_bytes']:,} | {st['unique_tokens']:,} |",
              f"| per-call log (ids) | {st['per_call_log_bytes']:,} | {st['per_call_tokens']:,} |",
              f"| per-call log (ids + logprobs) | {st['per_call_log_with_logprobs_bytes']:,} | |",
              f"| ratio (ids log / store) | {st['ratio_vs_ids_log']:.1f}x | |", "",
              *formats_markdown(report["formats"]), "",
              "targets: " + ", ".join(f"{k}={'met' if v else 'MISSED'}"
                                      for k, v in summary["targets"].items()),
              f"load average at the end: {report['machine']['load_average']}"]
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
    print("(d) reasoning template and tool-call format", flush=True)
    report["formats"] = await format_latency(model_dir, work_dir, num_calls, run_pairs)
    report["summary"] = summarise(report)
    return report


async def run_formats(work_dir: Path, num_calls: int) -> dict:
    from undertow.learner.modeldir import init_model_dir

    model_dir = init_model_dir(work_dir / "tiny", size="tiny", seed=0)
    return {"formats": await format_latency(model_dir, work_dir, num_calls, run_pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-calls", type=int, default=200)
    parser.add_argument("--skip-litellm", action="store_true")
    parser.add_argument("--only-formats", action="store_true",
                        help="run only part (d) (reasoning template, non-Hermes parser)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="undertow-bench-gateway-") as work_dir:
        report = asyncio.run(run_formats(Path(work_dir), args.num_calls) if args.only_formats
                             else run(Path(work_dir), args.num_calls, not args.skip_litellm))
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                         "load_average_at_start": load_before,
                         "load_average": os.getloadavg()}
    results = FORMATS_RESULTS if args.only_formats else RESULTS
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(formats_markdown(report["formats"])) if args.only_formats
          else markdown(report))


if __name__ == "__main__":
    main()
