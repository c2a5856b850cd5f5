"""Rollouts on this machine: sessions per minute and the gateway's share of session time.

    python -m benchmarks.rollout [--concurrency 1 4 8] [--num-tasks 4] [--group-size 2]

The real mini-swe-agent runs each session in a Docker sandbox against the gateway, in
front of a scripted engine (a real server speaking SGLang's `/generate`, replying at
once), so that the model's speed does not hide the harness's. Each session makes three
calls (`ls`, `git status`, submit) and is graded. Per concurrency level, on a fresh
gateway:

- sessions per minute: sessions / wall time of the rollout;
- gateway overhead share: (time the gateway spent on calls, from its
  `undertow_call_duration_seconds` histogram, less the time the engine spent answering
  them) / the sessions' total duration.

Writes benchmarks/results/rollout.json and prints a Markdown table.
"""

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.gateway.scripted_engine import ScriptedEngine
from undertow.adapters.gateway_client import GatewayAdmin
from undertow.adapters.mini_swe_agent import MiniSweAgent
from undertow.adapters.rollout import Rollout, RolloutConfig
from undertow.gateway.render import Renderer
from undertow.learner.modeldir import init_model_dir
from undertow.run.embedded import serve_gateway
from undertow.sandboxes.connection import connect
from undertow.sandboxes.task import load_tasks
from undertow.sandboxes.taskset import BUNDLED_DIR

RESULTS_DIR = Path(__file__).parent / "results"
COMMANDS = ("ls", "git status --short", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")


class TurnEngine(ScriptedEngine):
    """Replies to a session's k-th call with the k-th scripted turn (sessions interleave,
    so the reply is chosen from the prompt, not from the order of requests), and
    measures the time it spends answering."""

    def __init__(self, renderer: Renderer, turns: list[list[int]], stop_ids: tuple[int, ...]):
        super().__init__(default=turns[-1], stop_token_ids=stop_ids)
        self.renderer, self.turns, self.engine_s = renderer, turns, 0.0
        self._next: list[int] = turns[0]

    def _completion(self, params: dict):
        self.scripts = [list(self._next)]
        return super()._completion(params)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        body = await request.json()  # cached: the parent's read does not suspend
        prompt = self.renderer.decode(body["input_ids"], skip_special_tokens=False)
        turn = prompt.count("<|im_start|>assistant") - 1
        self._next = self.turns[min(turn, len(self.turns) - 1)]
        try:
            return await super().generate(request)
        finally:
            self.engine_s += time.perf_counter() - started


def oracle_turns(renderer: Renderer, stop_id: int) -> list[list[int]]:
    texts = [f"THOUGHT: step {i}.\n\n<tool_call>\n"
             f"{json.dumps({'name': 'bash', 'arguments': {'command': command}})}\n</tool_call>"
             for i, command in enumerate(COMMANDS)]
    return [renderer.encode(text) + [stop_id] for text in texts]


async def _gateway_call_s(url: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as reply:
        text = await reply.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("undertow_call_duration_seconds_sum"))


async def measure(model_dir: Path, tasks: list, concurrency: int, group_size: int,
                  scratch: Path) -> dict:
    renderer = Renderer(model_dir)
    stop_ids = tuple(sorted(renderer.stop_token_ids))
    engine = TurnEngine(renderer, oracle_turns(renderer, stop_ids[0]), stop_ids)
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with (serve_gateway(model_dir, scratch / f"store-c{concurrency}",
                                  [engine_url]) as gateway,
                    GatewayAdmin(gateway.url, gateway.admin_token) as admin):
            with connect(os.environ.get("DOCKER_HOST")) as connection:
                config = RolloutConfig(group_size=group_size, concurrency=concurrency,
                                       timeout_s=600, out_dir=scratch, progress_interval_s=0)
                started = time.perf_counter()
                summary = await Rollout(tasks, MiniSweAgent(step_limit=6), admin, connection,
                                        config).run()
                wall_s = time.perf_counter() - started
            gateway_s = await _gateway_call_s(gateway.url)
    finally:
        await runner.cleanup()
    session_s = sum(r.duration_s for r in summary.sessions)
    num_calls = sum(r.num_calls for r in summary.sessions)
    return {"concurrency": concurrency, "num_sessions": len(summary.sessions),
            "causes": sorted({r.cause for r in summary.sessions}), "num_calls": num_calls,
            "wall_s": wall_s, "sessions_per_minute": 60 * len(summary.sessions) / wall_s,
            "mean_session_s": session_s / len(summary.sessions),
            "gateway_call_s": gateway_s, "engine_s": engine.engine_s,
            "gateway_overhead_s_per_call": (gateway_s - engine.engine_s) / max(num_calls, 1),
            "gateway_overhead_share": (gateway_s - engine.engine_s) / session_s}


def table(rows: list[dict]) -> str:
    lines = ["| concurrency | sessions | sessions/min | mean session (s) | calls | "
             "gateway overhead per call (ms) | gateway overhead share |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['concurrency']} | {row['num_sessions']} | "
                     f"{row['sessions_per_minute']:.1f} | {row['mean_session_s']:.1f} | "
                     f"{row['num_calls']} | {1000 * row['gateway_overhead_s_per_call']:.1f} | "
                     f"{row['gateway_overhead_share']:.2%} |")
    base = rows[0]["sessions_per_minute"]
    lines.append("")
    lines.append("Throughput relative to concurrency " + str(rows[0]["concurrency"]) + ": " +
                 ", ".join(f"C={r['concurrency']}: {r['sessions_per_minute'] / base:.2f}x"
                           for r in rows))
    return "\n".join(lines)


async def main(args) -> None:
    tasks = load_tasks(BUNDLED_DIR)[:args.num_tasks]
    with tempfile.TemporaryDirectory(prefix="undertow-bench-rollout-") as scratch:
        scratch = Path(scratch)
        model_dir = init_model_dir(scratch / "tiny", size="tiny", seed=0)
        rows = [await measure(model_dir, tasks, concurrency, args.group_size, scratch)
                for concurrency in args.concurrency]
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "rollout.json").write_text(json.dumps({"levels": rows}, indent=2))
    print(table(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--num-tasks", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
