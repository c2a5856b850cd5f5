"""`undertow ui` on a long session: how long a 50-turn, 100k-token session takes to open.

    python -m benchmarks.ui [--num-turns 50] [--num-tokens 100000] [--repeats 5] [--model DIR]

Builds a run directory whose store holds one group with one session of `--num-turns`
calls, each adding new prompt tokens and a sampled reply (`--num-tokens` in all),
recorded by the gateway's own `Tree.add_call` and written by its `TreeStore`; starts
`undertow ui` on it (a subprocess, as a user would) and times, in Debian's chromium
driven by Playwright, from navigation to the session page until it has drawn its first
page of calls (`body[data-ready]` set after rendering), cold (the server replays the
store first) and warm; the same for the last page of calls and the group's tree; and
the JSON answer alone.

Writes benchmarks/results/ui.json and prints a Markdown table.
"""

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from undertow.gateway.front.store import TreeStore
from undertow.gateway.trees.tree import Tree

RESULTS_DIR = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
GROUP, SESSION = "g000000-r0", "s-long"


async def write_long_session(store_dir: Path, num_turns: int, num_tokens: int,
                             vocab_size: int) -> int:
    """One session of `num_turns` calls; each call's prompt is the previous call's
    prompt and reply plus new tokens (a tool result), its reply a quarter of its part."""
    rng = random.Random(0)
    per_turn = num_tokens // num_turns
    num_reply = per_turn // 4
    store = TreeStore(store_dir)
    await store.start()
    tree, history = Tree(GROUP), []
    for turn in range(num_turns):
        prompt = history + [rng.randrange(vocab_size) for _ in range(per_turn - num_reply)]
        reply = [rng.randrange(vocab_size) for _ in range(num_reply)]
        logprobs = [-rng.expovariate(2.0) for _ in reply]
        record = tree.add_call(f"call-{turn:03d}", SESSION, prompt, reply, logprobs,
                               [turn // 10] * num_reply)
        await store.append(GROUP, record.to_json())
        history = prompt + reply
    await store.append(GROUP, {"kind": "session_close", "session_id": SESSION, "reward": 1.0,
                               "meta": {"cause": "exited", "duration_s": 3600.0}})
    await store.close()
    return tree.num_unique_tokens


def make_run(root: Path, model_dir: Path, num_turns: int, num_tokens: int) -> Path:
    from tokenizers import Tokenizer

    run = root / "runs" / "long"
    (run / "model-base").mkdir(parents=True)
    shutil.copy(model_dir / "tokenizer.json", run / "model-base" / "tokenizer.json")
    vocab_size = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    num_unique = asyncio.run(write_long_session(run / "store", num_turns, num_tokens,
                                                vocab_size))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "weight_version": 1}) + "\n")
    print(f"run {run}: {num_turns} calls, {num_unique} unique tokens", flush=True)
    return run


def start_viewer(runs_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    with open(log, "wb") as handle:
        process = subprocess.Popen([sys.executable, "-m", "undertow.cli", "ui", "--runs",
                                    str(runs_dir), "--port", "0"], cwd=REPO, stdout=handle,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("undertow ui: http://"):
                return process, line.split()[2]
        time.sleep(0.1)
    raise RuntimeError(f"undertow ui did not start: {log.read_text()}")


def time_page(browser, url: str, route: str) -> float:
    page = browser.new_page()
    started = time.perf_counter()
    page.goto(f"{url}/{route}")
    page.wait_for_selector(f'body[data-ready="{route}"]')
    elapsed = time.perf_counter() - started
    page.close()
    return elapsed


def time_json(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as reply:
        reply.read()
    return time.perf_counter() - started


def measure(url: str, repeats: int) -> dict[str, dict[str, float]]:
    from playwright.sync_api import sync_playwright

    base = f"#/run/long/session/{GROUP}/{SESSION}"
    routes = {"session, first page": base, "session, last page": f"{base}?offset=40",
              "group tree": f"#/run/long/tree/{GROUP}"}
    api = f"{url}/api/runs/long/groups/{GROUP}/sessions/{SESSION}?offset=0&limit=10"
    results: dict[str, dict[str, float]] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"),
                                             args=["--no-sandbox", "--disable-gpu"])
        cold = time_page(browser, url, routes["session, first page"])
        results["session, first page (cold: store replayed)"] = {"p50_s": cold, "n": 1}
        for name, route in routes.items():
            times = [time_page(browser, url, route) for _ in range(repeats)]
            results[f"{name} (warm)"] = {"p50_s": statistics.median(times), "n": repeats,
                                         "max_s": max(times)}
        browser.close()
    for name, offset in (("first", 0), ("last", 40)):
        times = [time_json(api.replace("offset=0", f"offset={offset}")) for _ in range(repeats)]
        results[f"session JSON alone, {name} page (warm)"] = {
            "p50_s": statistics.median(times), "n": repeats, "max_s": max(times)}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-turns", type=int, default=50)
    parser.add_argument("--num-tokens", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: tiny)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = args.model
        if model_dir is None:
            from undertow.learner.modeldir import init_model_dir

            model_dir = init_model_dir(root / "tiny", size="tiny", seed=0)
        make_run(root, model_dir, args.num_turns, args.num_tokens)
        process, url = start_viewer(root / "runs", root / "ui.log")
        try:
            results = measure(url, args.repeats)
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
    report = {"num_turns": args.num_turns, "num_tokens": args.num_tokens,
              "cpus": os.cpu_count(), "results": results}
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "ui.json").write_text(json.dumps(report, indent=1))
    print(f"\n{args.num_turns}-turn, {args.num_tokens}-token session in `undertow ui` "
          f"(chromium, {os.cpu_count()} CPUs)\n")
    print("| view | p50 s | max s | n |\n| --- | --- | --- | --- |")
    for name, row in results.items():
        print(f"| {name} | {row['p50_s']:.3f} | {row.get('max_s', row['p50_s']):.3f} "
              f"| {row['n']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
