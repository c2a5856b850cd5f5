"""Side by side: the gateway of several commits, in one run, against one built-in engine.

    python -m benchmarks.gateway_ab [--num-calls 300] [--rounds 2] OLD_COMMIT NEW_COMMIT ...
    python -m benchmarks.gateway_ab --growing-calls 200 [--rounds 1] OLD_COMMIT NEW_COMMIT ...

Each commit's tree is exported (`git archive`) and its gateway started from it (a
package root of links, on PYTHONPATH in place of the installed editable package, gives
that tree's `undertow.*`, so the same virtualenv runs each commit's code). The calls are part (a) of
`benchmarks.gateway`: a new session per call, one short user message, `max_tokens` 2,
each call paired with the engine's `/generate`; the gateways' calls interleave round by
round (`run_pairs`), so load on the shared machine hits every commit alike. Printed per
commit and round: the added latency (p50, paired) and the gateway's CPU per call (p50).
Compare within a run; on a loaded machine the figures move between runs.

With `--growing-calls N`, the calls are those of `benchmarks.xlong` part (d) instead
(`xlong_growing.py`): one tool-calling session re-sending its whole history, ~2,000 tokens
more a call, in front of scripted engines (one per gateway, answering at once). Each
commit's gateway runs its own session (its replies make its history), the bare relay
(`benchmarks/bare_relay.py`, of this checkout, with every process-level setting the
gateway's `serve` makes) takes the first commit's bodies, and call by call the proxies take
turns in going first. Printed per commit and round: CPU per call (p50) over the first and
the last `xlong_growing.WINDOW` calls, and the last window against the relay's.
"""

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

from benchmarks import xlong_growing
from benchmarks.gateway import NUM_WARMUP, run_pairs
from benchmarks.proxies import (
    ADMIN_TOKEN,
    TIMEOUT,
    open_session,
    post,
    post_read,
    start_bare_relay,
    stop,
)
from benchmarks.xlong_session import Texts
from undertow.gateway.engines.launch import launch_engine
from undertow.gateway.render import Renderer
from undertow.learner.modeldir import init_model_dir

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("gateway", "adapters", "learner", "sandboxes")  # setup.py's package-dir map


def export(commit: str, work_dir: Path) -> Path:
    """The commit's tree under `work_dir`, and a package root whose `undertow` is it."""
    tree = work_dir / commit
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    package = work_dir / f"{commit}-root" / "undertow"
    package.mkdir(parents=True)
    for entry in (tree / "undertow").iterdir():
        (package / entry.name).symlink_to(entry)
    for name in SUBPACKAGES:
        (package / name).symlink_to(tree / name)
    return package.parent


# Drops the installed (editable) package's finder, so that `undertow` comes from PYTHONPATH.
DROP_EDITABLE_HOOK = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if not "
                      "getattr(f, '__module__', '').startswith('__editable__')]")
BOOTSTRAP = (DROP_EDITABLE_HOOK + "; import runpy; "
             "runpy.run_module('undertow.cli', run_name='__main__', alter_sys=True)")


async def start_gateway(root: Path, engine_url: str, model_dir: Path, store_dir: Path,
                        *overrides: str):
    command = [sys.executable, "-c", BOOTSTRAP, "gateway", "serve", "--engine",
               engine_url, "--model", str(model_dir), "--store", str(store_dir), "--port", "0",
               *overrides]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "UNDERTOW_ADMIN_TOKEN": ADMIN_TOKEN, "PYTHONPATH": str(root)},
        cwd=root)  # not this checkout: `-c` puts the working directory first on sys.path
    while True:
        line = (await asyncio.wait_for(process.stdout.readline(), 120)).decode()
        if not line:
            raise RuntimeError(f"the gateway of {root} exited before it listened")
        if "listening on" in line:
            return process, line.split("listening on", 1)[1].strip()


async def one_round(roots: dict[str, Path], work_dir: Path, num_calls: int) -> dict:
    model_dir = work_dir / "tiny"
    if not model_dir.exists():
        init_model_dir(model_dir, size="tiny", seed=0)
    renderer = Renderer(model_dir)
    messages = [{"role": "user", "content": "Say hello."}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0.0}
    generate = {"input_ids": renderer.encode(renderer.render(messages,
                                                             add_generation_prompt=True)),
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    async with launch_engine("builtin", model_dir) as engine:
        gateways = {}
        try:
            for name, root in roots.items():
                gateways[name] = await start_gateway(root, engine.url, model_dir,
                                                     Path(tempfile.mkdtemp(dir=work_dir)))
            async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
                pairs = {}
                for name, (_, url) in gateways.items():
                    sessions = [await open_session(http, url, "ab")
                                for _ in range(num_calls + NUM_WARMUP)]
                    pairs[name] = (
                        lambda i: post_read(http, engine.url + "/generate", generate),
                        lambda i, sessions=sessions: post(
                            http, sessions[i]["base_url"] + "/chat/completions", chat,
                            {"Authorization": f"Bearer {sessions[i]['api_key']}"}))
                pids = {name: process.pid for name, (process, _) in gateways.items()}
                return await run_pairs(pairs, pids, num_calls)
        finally:
            for process, _ in gateways.values():
                await stop(process)


async def growing_round(roots: dict[str, Path], work_dir: Path, num_calls: int) -> dict:
    """One growing session per commit's gateway and the relay, calls interleaved (see the
    module docstring); per proxy its calls' CPU ms."""
    model_dir = work_dir / "tiny"
    if not model_dir.exists():
        init_model_dir(model_dir, size="tiny", seed=0)
    renderer = Renderer(model_dir)
    texts = Texts(renderer)
    stop_id = renderer.tokenizer.token_to_id("<|im_end|>")
    scripts = xlong_growing.tool_call_completions(renderer, texts, stop_id, num_calls)
    first_prompt = renderer.encode(renderer.render(
        xlong_growing.GrowingScaffold(texts).messages, xlong_growing.TOOLS,
        add_generation_prompt=True))
    processes, runners, proxies = [], [], {}
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            for name, root in [*roots.items(), ("relay", None)]:
                engine, runner, engine_url = await xlong_growing.start_engine(scripts, stop_id)
                runners.append(runner)
                process, url = (
                    await start_bare_relay(engine_url, first_prompt) if root is None else
                    await start_gateway(root, engine_url, model_dir,
                                        Path(tempfile.mkdtemp(dir=work_dir)),
                                        f"context_length={2**21}"))
                processes.append(process)
                proxies[name] = xlong_growing.Proxy(process, await open_session(http, url, "ab"),
                                                    engine)
            return await drive_growing(http, proxies, texts, num_calls)
    finally:
        for process in processes:
            await stop(process)
        for runner in runners:
            await runner.cleanup()


async def drive_growing(http: aiohttp.ClientSession, proxies: dict, texts: Texts,
                        num_calls: int) -> dict[str, list[float]]:
    names = list(proxies)
    scaffolds = {name: xlong_growing.GrowingScaffold(texts) for name in names if name != "relay"}
    replies: dict[str, dict | None] = dict.fromkeys(scaffolds)
    cpu_ms: dict[str, list[float]] = {name: [] for name in names}
    for call in range(1, num_calls + 1):
        bodies = {name: scaffold.next_body(call, replies[name])
                  for name, scaffold in scaffolds.items()}
        bodies["relay"] = bodies[names[0]]
        for name in names[call % len(names):] + names[:call % len(names)]:
            reply, cost = await proxies[name].call(http, bodies[name])
            cpu_ms[name].append(cost["cpu_ms"])
            if name != "relay":
                replies[name] = reply
    return cpu_ms


def print_growing(number: int, cpu_ms: dict[str, list[float]]) -> None:
    window = xlong_growing.WINDOW
    relay_late = statistics.median(cpu_ms["relay"][-window:])
    load = " ".join(f"{value:.1f}" for value in os.getloadavg())
    for name, values in cpu_ms.items():
        late = statistics.median(values[-window:])
        print(f"| {number} | {name} | {statistics.median(values[:window]):.2f} | {late:.2f} | "
              f"{late / relay_late:.2f}x | {load} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commits", nargs="+")
    parser.add_argument("--num-calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--growing-calls", type=int, default=0,
                        help="N > 0: xlong part (d)'s growing session of N calls instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="undertow-gateway-ab-") as work:
        roots = {commit: export(commit, Path(work)) for commit in args.commits}
        if args.growing_calls:
            print(f"| round | proxy | CPU ms/call p50, first {xlong_growing.WINDOW} | last "
                  f"{xlong_growing.WINDOW} | last / relay | load |")
            print("|---:|---|---:|---:|---:|---|")
        else:
            print("| round | commit | added p50 ms | gateway CPU ms/call p50 | load |")
            print("|---:|---|---:|---:|---|")
        for number in range(1, args.rounds + 1):
            if args.growing_calls:
                print_growing(number, asyncio.run(growing_round(roots, Path(work),
                                                                args.growing_calls)))
                continue
            result = asyncio.run(one_round(roots, Path(work), args.num_calls))
            load = " ".join(f"{value:.1f}" for value in os.getloadavg())
            for commit, row in result.items():
                print(f"| {number} | {commit} | {row['added_p50_ms']:.2f} | "
                      f"{row['cpu_ms_per_call_p50']:.2f} | {load} |", flush=True)


if __name__ == "__main__":
    main()
