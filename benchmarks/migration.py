"""Migration benchmark (issue 7): the pause a session sees when its engine is drained with
`migrate` mid-generation, KV transfer versus re-prefill on the target.

    python -m benchmarks.migration [--contexts 1024,8192,32768] [--reps-kv 9] [--reps 3]
                                   [--reps-slow 1] [--modes kv_transfer,re_prefill]

Two built-in engines on the tiny model (one torch thread each), behind the gateway's engine
pool (`gateway/engine_pool/pool.py`). For each context length L and each mode, a session
streams a greedy generation from an L-token prompt on engine e0; after 16 tokens the pool
drains e0 with `migrate=True`, and the generation continues on e1. The consumer of
`pool.generate` (the code that streams to the scaffold) timestamps every token; the pause is
the gap between the last token produced on e0 and the first produced on e1. Modes:
`kv_transfer` (the staged copy of `gateway/engine_pool/migration.py`) and `re_prefill` (the
same pool with the copy off: e1 prefills the history). e1's cache is flushed before each run,
so nothing of the session is on it but what migration puts there; e0's prefix cache gets the
prompt once per L, before the first run (that prefill is not part of any pause). Also reported:
the median gap between tokens before the migration (the normal decode step), the pause beyond
it (a one-token step on the target over the whole context is the least a resume costs, and on
CPU that step grows with the context), and for KV transfer how long the drain call took (the
staged copy while decoding, plus the cut-over), how many tokens the last delta held, and where
the pause went: `tail` (from the last token from e0 to the end of the cut-over: the source
stops the request and returns the last delta, the target stages it while the attempt's stream
ends) and `resume` (from then to the first token from e1: the resume request by handle, the
target's decode step, the stream back). The JSON also has `stop_ms` and `stage_ms` (the
cut-over's two calls from the gateway; the stop includes waiting for the source's step in
progress, whose token is e0's last).

Target: with transfer, the pause does not grow with context length. Writes
`benchmarks/results/migration.json` and prints a Markdown table. Wall-clock numbers on a shared
2-core machine are noisy (other jobs stall a run now and then, at any context length): compare
medians within one run. A KV-transfer run takes seconds (`--reps-kv` of them per length), a
re-prefill run up to minutes (`--reps`, and `--reps-slow` at 16k tokens or more).
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import platform
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

from undertow.gateway.engine_pool.migration import MigrationConfig
from undertow.gateway.engine_pool.pool import EnginePool, PoolConfig
from undertow.gateway.engines.launch import BuiltinLauncher, launch_engine
from undertow.gateway.engines.protocol import GenerateRequest, SamplingParams
from undertow.gateway.engines.sglang import SGLangDriver
from undertow.gateway.metrics import GatewayMetrics

RESULTS = Path(__file__).parent / "results" / "migration.json"
TOKENS_BEFORE = 16
TOKENS_AFTER = 4
MAX_NEW_TOKENS = 4000
TOKEN_RANGE = (3, 2700)
CACHE_BYTES = 1 << 30
MODES = ("kv_transfer", "re_prefill")


class MovedLog(logging.Handler):
    """Keeps what `migration.py`'s "moved ..." log line says of the cut-over, and when it came
    (the cut-over's end: the resume starts right after it)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.moves: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = re.search(r"last delta: (\d+); stop ([\d.]+) ms, stage ([\d.]+) ms",
                          record.getMessage())
        if match:
            self.moves.append({"last_delta_tokens": int(match[1]), "stop_ms": float(match[2]),
                               "stage_ms": float(match[3]), "logged_s": time.perf_counter()})


async def one_run(pool: EnginePool, urls: list[str], input_ids: list[int], name: str,
                  moved: MovedLog) -> dict:
    """One migrated generation on e0 -> e1; the timings the consumer sees."""
    source = pool.engines[0]
    await pool.add_engine(urls[0])  # back to healthy after the previous run's drain
    async with SGLangDriver(urls[1]) as client:
        await client.flush_cache()
    pool.router.assign(name, source.engine_id, input_ids)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=MAX_NEW_TOKENS)
    arrivals: list[float] = []
    drain, attempt, drain_s = None, None, 0.0
    stream = pool.generate(name, GenerateRequest(input_ids=input_ids, sampling_params=params,
                                                 rid=name, return_logprob=True))
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
    run = {"pause_s": arrivals[num_on_source] - arrivals[num_on_source - 1],
           "decode_gap_s": statistics.median(gaps), "drain_call_s": drain_s,
           "num_tokens_on_source": num_on_source}
    if moved.moves:
        move = moved.moves[-1]
        run.update({key: move[key] for key in ("last_delta_tokens", "stop_ms", "stage_ms")})
        run["resume_ms"] = 1000 * (arrivals[num_on_source] - move["logged_s"])
        run["tail_ms"] = 1000 * (move["logged_s"] - arrivals[num_on_source - 1])
    return run


async def warm_source(url: str, input_ids: list[int]) -> None:
    """Put the prompt into e0's prefix cache (a migrated request leaves nothing cached)."""
    async with SGLangDriver(url) as client:
        await client.generate(GenerateRequest(input_ids=input_ids, sampling_params=SamplingParams(
            max_new_tokens=1, temperature=0.0)))


async def measure(model_dir: Path, contexts: list[int], modes: list[str],
                  reps: dict[tuple[str, int], int]) -> list[dict]:
    launcher = BuiltinLauncher(overrides={"num_threads": 1, "cache_bytes": CACHE_BYTES})
    moved = MovedLog()
    logging.getLogger("undertow.gateway.engine_pool.migration").addHandler(moved)
    logging.getLogger("undertow.gateway.engine_pool.migration").setLevel(logging.INFO)
    rows = []
    async with launch_engine(launcher, model_dir) as first, \
            launch_engine(launcher, model_dir) as second:
        urls = [first.url, second.url]
        for length in contexts:
            await warm_source(urls[0], prompt_of(length))
        for mode in modes:
            config = PoolConfig(health_interval_s=0.5, resume_timeout_s=1800.0,
                                migration=MigrationConfig(kv_transfer=mode == "kv_transfer"))
            pool = EnginePool(urls, config, metrics=GatewayMetrics.create())
            await pool.start()
            try:
                for length in contexts:
                    for rep in range(reps[mode, length]):
                        moved.moves.clear()
                        run = await one_run(pool, urls, prompt_of(length),
                                            f"{mode}-{length}-{rep}", moved)
                        run.update(mode=mode, context_tokens=length, rep=rep)
                        print(json.dumps(run), flush=True)
                        rows.append(run)
            finally:
                await pool.close()
    return rows


def prompt_of(length: int) -> list[int]:
    return random.Random(length).choices(range(*TOKEN_RANGE), k=length)


def summarize(rows: list[dict], contexts: list[int], modes: list[str]) -> list[dict]:
    table = []
    for length in contexts:
        entry: dict = {"context_tokens": length}
        for mode in modes:
            runs = [r for r in rows if r["mode"] == mode and r["context_tokens"] == length]
            entry[f"{mode}_pause_ms"] = 1000 * statistics.median(r["pause_s"] for r in runs)
            entry[f"{mode}_decode_gap_ms"] = 1000 * statistics.median(
                r["decode_gap_s"] for r in runs)
            entry[f"{mode}_pause_over_step_ms"] = statistics.median(
                1000 * (r["pause_s"] - r["decode_gap_s"]) for r in runs)
            if mode == "kv_transfer":
                entry["kv_drain_call_ms"] = 1000 * statistics.median(
                    r["drain_call_s"] for r in runs)
                entry["kv_last_delta_tokens"] = max(r.get("last_delta_tokens") or 0
                                                    for r in runs)
                for key in ("stop_ms", "stage_ms", "tail_ms", "resume_ms"):
                    entry[f"kv_{key}"] = statistics.median(r.get(key, math.nan) for r in runs)
        if len(modes) == len(MODES):
            entry["re_prefill_over_kv"] = (entry["re_prefill_pause_ms"]
                                           / entry["kv_transfer_pause_ms"])
        table.append(entry)
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| context | pause, KV transfer (ms) | pause, re-prefill (ms) | ratio | "
             "decode step (ms) | KV pause beyond a step (ms) | KV pause: tail + resume (ms) | "
             "drain call, KV (ms) | last delta (tokens) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for e in table:
        lines.append(
            f"| {e['context_tokens']} | {e.get('kv_transfer_pause_ms', math.nan):.1f} | "
            f"{e.get('re_prefill_pause_ms', math.nan):.1f} | "
            f"{e.get('re_prefill_over_kv', math.nan):.1f}x | "
            f"{e.get('kv_transfer_decode_gap_ms', math.nan):.1f} | "
            f"{e.get('kv_transfer_pause_over_step_ms', math.nan):.1f} | "
            f"{e.get('kv_tail_ms', math.nan):.1f} + {e.get('kv_resume_ms', math.nan):.1f} | "
            f"{e.get('kv_drain_call_ms', math.nan):.0f} "
            f"| {e.get('kv_last_delta_tokens', '-')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--reps-kv", type=int, default=9, help="repetitions with KV transfer")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of re-prefill")
    parser.add_argument("--reps-slow", type=int, default=1,
                        help="repetitions of re-prefill at 16k tokens and more (minutes each)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    modes = [m for m in MODES if m in args.modes.split(",")]
    reps = {(m, c): args.reps_kv if m == "kv_transfer" else
            args.reps_slow if c >= 16384 else args.reps for m in modes for c in contexts}
    from undertow.learner.modeldir import init_model_dir

    with tempfile.TemporaryDirectory(prefix="undertow-bench-migration-") as work_dir:
        model_dir = init_model_dir(Path(work_dir) / "tiny", size="tiny", seed=0)
        started = time.perf_counter()
        rows = asyncio.run(measure(model_dir, contexts, modes, reps))
    table = summarize(rows, contexts, modes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "model": "tiny", "tokens_before_migration": TOKENS_BEFORE,
        "reps": {f"{m}@{c}": n for (m, c), n in reps.items()},
        "wall_s": time.perf_counter() - started, "table": table, "runs": rows}, indent=2) + "\n")
    print(markdown(table))


if __name__ == "__main__":
    main()
