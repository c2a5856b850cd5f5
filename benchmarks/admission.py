"""Admission benchmark: the same overload answered by refusal and by the fair wait, in one run.

    python -m benchmarks.admission [--num-sessions 200] [--num-calls 5] [--group-size 8]
                                   [--rounds 2] [--wait-s 60]

One built-in engine (tiny model) and two gateways in front of it (`undertow gateway serve`,
subprocesses, `router.max_in_flight_per_engine=64` as by default): "refuse" with
`router.admission_wait_s=0` (the policy before: a call that finds the engine at its bound is
answered 429 at once) and "wait" with `router.admission_wait_s=--wait-s` (the call queues,
round-robin over groups then sessions, and gets a 429 only past the wait). Each round opens
`--num-sessions` sessions in groups of `--group-size` and starts them all at once; each session
makes `--num-calls` chat calls in turn through the real `openai` SDK with its retries off
(4 output tokens each; a refused call is counted and the session goes on with its next call,
as the issue measured). The arms take turns, refuse-wait-wait-refuse for two rounds, so that
the machine's load drifts over both alike; the load average is recorded around each round.

Per arm: calls answered 200, 429 and otherwise; p50 and p99 of the call latency (request to
reply, as the scaffold sees it, waiting included); for each group the longest latency of any
of its calls (the longest a group's scaffold waited), reported as the median and the worst over
groups; and the gateway's own admission waits (`undertow_admission_wait_seconds`: how many
calls queued, their mean wait, and the bucket that holds the longest).

Writes `benchmarks/results/admission.json` and prints a Markdown table. The machine is shared:
compare the arms within one run.
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.gateway import percentile
from benchmarks.proxies import ADMIN_TOKEN, listening_url, stop
from undertow.gateway.engines.launch import launch_engine

RESULTS = Path(__file__).parent / "results" / "admission.json"
ARMS = ("refuse", "wait")
WAIT_METRIC = "undertow_admission_wait_seconds"


async def start_gateway(engine_url: str, model_dir: Path, store_dir: Path, wait_s: float
                        ) -> tuple[asyncio.subprocess.Process, str, asyncio.Task]:
    """A gateway subprocess with the given admission wait; its output is read on (a task)
    so that its pipe never fills."""
    command = [sys.executable, "-m", "undertow.cli", "gateway", "serve", "--engine", engine_url,
               "--model", str(model_dir), "--store", str(store_dir), "--port", "0",
               f"router.admission_wait_s={wait_s}"]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "UNDERTOW_ADMIN_TOKEN": ADMIN_TOKEN})
    url = await listening_url(process, "the gateway")
    assert process.stdout is not None
    return process, url, asyncio.create_task(process.stdout.read())


async def run_session(client: openai.AsyncOpenAI, group: str, num_calls: int,
                      calls: list[dict]) -> None:
    """One session's calls in turn; each answered call's reply joins the history."""
    messages: list = []
    for turn in range(num_calls):
        messages.append({"role": "user", "content": f"Step {turn}: what next for {group}?"})
        started_s = time.perf_counter()
        status = 200
        try:
            reply = await client.chat.completions.create(model="tiny", messages=messages,
                                                         max_tokens=4)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        except openai.APIStatusError as error:
            status = error.status_code
            messages.pop()
        except openai.APIError:
            status = -1  # no HTTP reply (a connection error, a timeout)
            messages.pop()
        calls.append({"group": group, "status": status,
                      "latency_s": time.perf_counter() - started_s})


async def open_session(http: httpx.AsyncClient, url: str, group: str) -> dict:
    reply = await http.post(url + "/admin/sessions", json={"group": group},
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    reply.raise_for_status()
    return reply.json()


async def admission_waits(http: httpx.AsyncClient, url: str) -> dict:
    """The gateway's admission-wait histogram: per outcome, its count, sum and buckets."""
    text = (await http.get(url + "/metrics")).text
    waits: dict = {}
    for family in text_string_to_metric_families(text):
        if family.name != WAIT_METRIC:
            continue
        for sample in family.samples:
            entry = waits.setdefault(sample.labels["outcome"],
                                     {"count": 0.0, "sum": 0.0, "buckets": {}})
            if sample.name.endswith("_count"):
                entry["count"] = sample.value
            elif sample.name.endswith("_sum"):
                entry["sum"] = sample.value
            elif sample.name.endswith("_bucket"):
                entry["buckets"][sample.labels["le"]] = sample.value
    return waits


def waits_since(before: dict, after: dict) -> dict:
    """The admitted calls' waits during a round: count, mean, and the upper bound of the
    bucket holding the longest."""
    start = before.get("admitted", {"count": 0.0, "sum": 0.0, "buckets": {}})
    end = after.get("admitted", {"count": 0.0, "sum": 0.0, "buckets": {}})
    count = end["count"] - start["count"]
    longest = next((le for le, value in end["buckets"].items()
                    if value - start["buckets"].get(le, 0.0) >= count), "0") if count else "0"
    return {"num_waited": int(count),
            "mean_wait_s": (end["sum"] - start["sum"]) / count if count else 0.0,
            "longest_wait_at_most_s": float(longest)}


async def run_round(url: str, args: argparse.Namespace, tag: str) -> dict:
    """`num_sessions` sessions started together against one gateway; every call's result."""
    calls: list[dict] = []
    limits = httpx.Limits(max_connections=2 * args.num_sessions,
                          max_keepalive_connections=2 * args.num_sessions)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        sessions = []
        for index in range(args.num_sessions):
            group = f"{tag}-g{index // args.group_size:03d}"
            session = await open_session(http, url, group)
            sessions.append((group, session))
        before = await admission_waits(http, url)
        load_before = os.getloadavg()
        started_s = time.perf_counter()
        clients = [(group, openai.AsyncOpenAI(base_url=session["base_url"],
                                              api_key=session["api_key"], max_retries=0,
                                              http_client=http))
                   for group, session in sessions]
        await asyncio.gather(*(run_session(client, group, args.num_calls, calls)
                               for group, client in clients))
        wall_s = time.perf_counter() - started_s
        after = await admission_waits(http, url)
    return {"calls": calls, "wall_s": wall_s, "load_average_before": load_before,
            "load_average_after": os.getloadavg(), "gateway_waits": waits_since(before, after)}


def summarise(rounds: list[dict]) -> dict:
    """Per arm, over its rounds: outcomes, latency percentiles, the longest call per group."""
    calls = [call for entry in rounds for call in entry["calls"]]
    latencies = [call["latency_s"] for call in calls]
    answered = [call["latency_s"] for call in calls if call["status"] == 200]
    longest: dict[str, float] = {}
    for call in calls:
        longest[call["group"]] = max(longest.get(call["group"], 0.0), call["latency_s"])
    waits = [entry["gateway_waits"] for entry in rounds]
    num_waited = sum(w["num_waited"] for w in waits)
    return {
        "num_calls": len(calls),
        "num_200": sum(call["status"] == 200 for call in calls),
        "num_429": sum(call["status"] == 429 for call in calls),
        "num_other_errors": sum(call["status"] not in (200, 429) for call in calls),
        "p50_s": statistics.median(latencies), "p99_s": percentile(latencies, 0.99),
        "answered_p50_s": statistics.median(answered) if answered else None,
        "answered_p99_s": percentile(answered, 0.99) if answered else None,
        "group_longest_median_s": statistics.median(longest.values()),
        "group_longest_max_s": max(longest.values()),
        "num_groups": len(longest),
        "gateway_num_waited": num_waited,
        "gateway_mean_wait_s": (sum(w["mean_wait_s"] * w["num_waited"] for w in waits)
                                / num_waited if num_waited else 0.0),
        "gateway_longest_wait_at_most_s": max(w["longest_wait_at_most_s"] for w in waits),
        "wall_s": [round(entry["wall_s"], 1) for entry in rounds],
        "load_average": [entry["load_average_before"][0] for entry in rounds]
        + [rounds[-1]["load_average_after"][0]],
    }


def markdown(report: dict) -> str:
    config = report["config"]
    lines = [f"{config['num_sessions']} sessions x {config['num_calls']} calls, groups of "
             f"{config['group_size']}, {config['rounds']} rounds per arm, one built-in engine, "
             f"max_in_flight_per_engine=64, SDK retries off",
             "",
             "| measure | refuse (`admission_wait_s=0`) | wait "
             f"(`admission_wait_s={config['wait_s']:g}`) |",
             "|---|---:|---:|"]
    arms = [report["arms"][arm] for arm in ARMS]

    def row(name: str, values: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(values) + " |")

    row("calls answered 200 / 429 / other", [f"{a['num_200']} / {a['num_429']} / "
                                             f"{a['num_other_errors']}" for a in arms])
    row("call latency p50 / p99 (all calls)", [f"{a['p50_s']:.2f} / {a['p99_s']:.2f} s"
                                               for a in arms])
    row("answered calls' latency p50 / p99", [f"{a['answered_p50_s']:.2f} / "
                                              f"{a['answered_p99_s']:.2f} s" for a in arms])
    row("longest call per group: median / worst over groups",
        [f"{a['group_longest_median_s']:.2f} / {a['group_longest_max_s']:.2f} s" for a in arms])
    row("calls that queued; mean wait; longest wait (bucket bound)",
        [f"{a['gateway_num_waited']}; {a['gateway_mean_wait_s']:.2f} s; <= "
         f"{a['gateway_longest_wait_at_most_s']:g} s" for a in arms])
    row("round wall time", [", ".join(f"{s} s" for s in a["wall_s"]) for a in arms])
    lines += ["", f"load average (1 min) around the rounds, in order "
                  f"{' '.join(report['order'])}: {report['load_average']}"]
    return "\n".join(lines)


async def run(work_dir: Path, args: argparse.Namespace) -> dict:
    from undertow.learner.modeldir import init_model_dir

    model_dir = init_model_dir(work_dir / "tiny", size="tiny", seed=0)
    order = [ARMS[0], ARMS[1], ARMS[1], ARMS[0]] * ((args.rounds + 1) // 2)
    order = order[:2 * args.rounds]
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    loads: list[float] = []
    async with launch_engine("builtin", model_dir) as engine:
        gateways = {arm: await start_gateway(engine.url, model_dir, work_dir / f"store-{arm}",
                                             0 if arm == "refuse" else args.wait_s)
                    for arm in ARMS}
        try:
            for number, arm in enumerate(order):
                print(f"round {number + 1}/{len(order)}: {arm}", flush=True)
                result = await run_round(gateways[arm][1], args, f"r{number}")
                rounds[arm].append(result)
                loads.append(round(result["load_average_before"][0], 2))
        finally:
            for process, _, drain in gateways.values():
                await stop(process)
                await drain
    loads.append(round(os.getloadavg()[0], 2))
    return {"config": vars(args), "order": order, "load_average": loads,
            "arms": {arm: summarise(rounds[arm]) for arm in ARMS},
            "rounds": {arm: [{key: value for key, value in entry.items() if key != "calls"}
                             for entry in rounds[arm]] for arm in ARMS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-sessions", type=int, default=200)
    parser.add_argument("--num-calls", type=int, default=5)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per arm")
    parser.add_argument("--wait-s", type=float, default=60.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="undertow-bench-admission-") as work_dir:
        report = asyncio.run(run(Path(work_dir), args))
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
