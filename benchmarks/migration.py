"""Migration benchmark (issue 7): the pause a session sees when its engine is drained with
`migrate` mid-generation, KV transfer versus re-prefill on the target.

    python -m benchmarks.migration [--contexts 1024,8192,32768] [--reps 3] [--reps-32k 2]

Two built-in engines on the tiny model (one torch thread each), behind the gateway's engine
pool (`gateway/pool.py`). For each context length L and each mode, a session streams a greedy
generation from an L-token prompt on engine e0; after 16 tokens the pool drains e0 with
`migrate=True`, and the generation continues on e1. The consumer of `pool.generate` (the code
that streams to the scaffold) timestamps every token; the pause is the gap between the last
token produced on e0 and the first produced on e1. Modes: `kv_transfer` (the staged copy of
`gateway/migration.py`) and `re_prefill` (the same pool with the copy off: e1 prefills the
history). e1's cache is flushed before each run, so nothing of the session is on it but what
migration puts there; e0 keeps its prefix cache, so only the first run per L prefills the prompt
there (that prefill is not part of any pause). Also reported: the median gap between tokens
before the migration (the normal decode step), and for KV transfer how long the drain call took
(the staged copy while decoding, plus the cut-over) and how many tokens the last delta held.

Target: with transfer, the pause does not grow with context length. Writes
`benchmarks/results/migration.json` and prints a Markdown table. Wall-clock numbers on a shared
2-core machine are noisy: compare within one run.
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import platform
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

from undertow.gateway.engines.client import SGLangClient
from undertow.gateway.engines.launch import BuiltinLauncher, launch_engine
from undertow.gateway.metrics import GatewayMetrics
from undertow.gateway.migration import MigrationConfig
from undertow.gateway.pool import EnginePool, PoolConfig

RESULTS = Path(__file__).parent / "results" / "migration.json"
TOKENS_BEFORE = 16
TOKENS_AFTER = 4
MAX_NEW_TOKENS = 4000
TOKEN_RANGE = (3, 2700)
CACHE_BYTES = 1 << 30
MODES = ("kv_transfer", "re_prefill")


class MovedLog(logging.Handler):
    """Keeps the size of the last delta from `migration.py`'s "moved ..." log lines."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.last_deltas: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = re.search(r"last delta: (\d+)", record.getMessage())
        if match:
            self.last_deltas.append(int(match[1]))


async def one_run(pool: EnginePool, urls: list[str], input_ids: list[int], name: str) -> dict:
    """One migrated generation on e0 -> e1; the timings the consumer sees."""
    source = pool.engines[0]
    await pool.add_engine(urls[0])  # back to healthy after the previous run's drain
    async with SGLangClient(urls[1]) as client:
        await client.flush_cache()
    pool.router.assign(name, source.engine_id, input_ids)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": MAX_NEW_TOKENS}
    arrivals: list[float] = []
    drain, attempt, drain_s = None, None, 0.0
    stream = pool.generate(name, input_ids, params, name)
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            now = time.perf_counter()
            arrivals += [now] * len(chunk.token_ids)
            if drain is None and len(arrivals) >= TOKENS_BEFORE:
                (attempt,) = source.attempts
                started = time.perf_counter()
                drain = asyncio.create_task(pool.drain_engine(source.engine_id, migrate=True))
            if drain is not None and drain.done() and not drain_s:
                await drain
                drain_s = time.perf_counter() - started
            if drain_s and len(arrivals) >= len(attempt.output_ids) + TOKENS_AFTER:
                break
    num_on_source = len(attempt.output_ids)
    gaps = [b - a for a, b in itertools.pairwise(arrivals[1:TOKENS_BEFORE])]
    return {"pause_s": arrivals[num_on_source] - arrivals[num_on_source - 1],
            "decode_gap_s": statistics.median(gaps), "drain_call_s": drain_s,
            "num_tokens_on_source": num_on_source}


async def measure(model_dir: Path, contexts: list[int], reps: dict[int, int]) -> list[dict]:
    launcher = BuiltinLauncher(extra_args=("--num-threads", "1", "--cache-bytes",
                                           str(CACHE_BYTES)))
    moved = MovedLog()
    logging.getLogger("undertow.gateway.migration").addHandler(moved)
    logging.getLogger("undertow.gateway.migration").setLevel(logging.INFO)
    rows = []
    async with launch_engine(launcher, model_dir) as first, \
            launch_engine(launcher, model_dir) as second:
        urls = [first.url, second.url]
        for mode in MODES:
            config = PoolConfig(health_interval_s=0.5, resume_timeout_s=1800.0,
                                migration=MigrationConfig(kv_transfer=mode == "kv_transfer"))
            pool = EnginePool(urls, config, metrics=GatewayMetrics.create())
            await pool.start()
            try:
                for length in contexts:
                    input_ids = random.Random(length).choices(range(*TOKEN_RANGE), k=length)
                    for rep in range(reps[length]):
                        moved.last_deltas.clear()
                        run = await one_run(pool, urls, input_ids, f"{mode}-{length}-{rep}")
                        run.update(mode=mode, context_tokens=length, rep=rep,
                                   last_delta_tokens=moved.last_deltas[-1]
                                   if moved.last_deltas else None)
                        print(json.dumps(run), flush=True)
                        rows.append(run)
            finally:
                await pool.close()
    return rows


def summarize(rows: list[dict], contexts: list[int]) -> list[dict]:
    table = []
    for length in contexts:
        entry = {"context_tokens": length}
        for mode in MODES:
            runs = [r for r in rows if r["mode"] == mode and r["context_tokens"] == length]
            entry[f"{mode}_pause_ms"] = 1000 * statistics.median(r["pause_s"] for r in runs)
            entry[f"{mode}_decode_gap_ms"] = 1000 * statistics.median(
                r["decode_gap_s"] for r in runs)
            if mode == "kv_transfer":
                entry["kv_drain_call_ms"] = 1000 * statistics.median(
                    r["drain_call_s"] for r in runs)
                entry["kv_last_delta_tokens"] = max(r["last_delta_tokens"] or 0 for r in runs)
        entry["re_prefill_over_kv"] = entry["re_prefill_pause_ms"] / entry["kv_transfer_pause_ms"]
        table.append(entry)
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| context | pause, KV transfer (ms) | pause, re-prefill (ms) | ratio | "
             "decode step (ms) | drain call, KV (ms) | last delta (tokens) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for e in table:
        lines.append(
            f"| {e['context_tokens']} | {e['kv_transfer_pause_ms']:.1f} | "
            f"{e['re_prefill_pause_ms']:.1f} | {e['re_prefill_over_kv']:.1f}x | "
            f"{e['kv_transfer_decode_gap_ms']:.1f} | {e['kv_drain_call_ms']:.0f} | "
            f"{e['kv_last_delta_tokens']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--reps-32k", type=int, default=2,
                        help="repetitions at 16k tokens and more (re-prefill takes minutes)")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    reps = {c: args.reps_32k if c >= 16384 else args.reps for c in contexts}
    from undertow.learner.modeldir import init_model_dir

    with tempfile.TemporaryDirectory(prefix="undertow-bench-migration-") as work_dir:
        model_dir = init_model_dir(Path(work_dir) / "tiny", size="tiny", seed=0)
        started = time.perf_counter()
        rows = asyncio.run(measure(model_dir, contexts, reps))
    table = summarize(rows, contexts)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "model": "tiny", "tokens_before_migration": TOKENS_BEFORE, "reps": reps,
        "wall_s": time.perf_counter() - started, "table": table, "runs": rows}, indent=2) + "\n")
    print(markdown(table))


if __name__ == "__main__":
    main()
