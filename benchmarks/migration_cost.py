"""KV migration cost (issue 36, item 7): what it costs another engine to take over a session
of L tokens, by KV transfer versus by re-prefilling the history, for L = 1k to 32k tokens.

    python -m benchmarks.migration_cost [--contexts 1024,2048,4096,8192,16384,32768]
                                        [--reps 3] [--model-dir DIR]

Two built-in engines (one torch thread each) on the tiny model of `undertow model init` (its
`max_position_embeddings` is 40,960, so 32k fits; `--model-dir` serves another, up to the
contexts whose float32 KV fits the 256 MiB a built-in engine takes in one request: about
5,800 tokens of SmolLM2-135M). The source holds the session S (L random ordinary token IDs)
in its prefix cache; each run brings the flushed target to the point where it has produced
the token after S, which is what a migrated session's resume asks of it. Arms, interleaved
(every repetition runs each arm at each length, the arms' order rotated from one repetition
to the next):

- `re_prefill`: `/generate` S on the target, which prefills all L tokens: what a migration
  to a real SGLang 0.5.23 server costs today (it has no KV transfer; docs/migration-sglang.md).
- `kv_import`: `export_kv` of S's first L - 1 tokens from the source's cache, `import_kv`
  into the target's prefix cache, then `/generate` S there (prefills 1 token; what a shared
  HiCache storage would give SGLang, in kind).
- `kv_staged`: the same export, `stage_kv` into a slot of its own on the target, then
  `generate_staged` of the last token (the path of `gateway/engine_pool/migration.py`).

Each arm's calls are timed from this client (so the HTTP and the (de)serialisation count);
`ms` is their sum, `pause_ms` the part a migration cannot hide while the source keeps decoding
(the whole of it for re-prefill; for the KV arms the last call: their copy runs during the
staged copy, `migration.py`), and each KV arm's ratio is re-prefill's `ms` over its own. The
next token must be the same in every arm (greedy): a run where it is not is flagged. Writes
`benchmarks/results/migration_cost.json` (every run, the table, the load average before and
after) and prints a Markdown table. The machine is shared: compare ratios within one run.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from undertow.gateway.builtin_engine.model_config import ModelConfig
from undertow.gateway.engines.launch import BuiltinLauncher, launch_engine
from undertow.gateway.engines.protocol import GenerateRequest, SamplingParams
from undertow.gateway.engines.sglang import SGLangDriver

RESULTS = Path(__file__).parent / "results" / "migration_cost.json"
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
ARMS = ("re_prefill", "kv_import", "kv_staged")
TOKEN_RANGE = (3, 2700)  # ordinary tokens of the tiny model (no special tokens)
CACHE_BYTES = 1 << 30  # the source caches every session at once (252 MB at 4 KiB a token)
GREEDY_ONE = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Engines:
    """The two engines' drivers: `source` caches every session, `target` takes them over."""

    source: SGLangDriver
    target: SGLangDriver


def session_ids(length: int) -> list[int]:
    return random.Random(length).choices(range(*TOKEN_RANGE), k=length)


class Clock:
    """Times a run's calls, in order, by name."""

    def __init__(self):
        self.calls_ms: dict[str, float] = {}

    async def time(self, name: str, call):
        started = time.perf_counter()
        result = await call
        self.calls_ms[name] = 1000 * (time.perf_counter() - started)
        return result


async def re_prefill(engines: Engines, ids: list[int], clock: Clock) -> dict:
    result = await clock.time("generate", engines.target.generate(
        GenerateRequest(input_ids=ids, sampling_params=GREEDY_ONE)))
    return {"next_token": result.output_ids[0], "cached_tokens": result.cached_tokens,
            "payload_bytes": 0}


async def kv_import(engines: Engines, ids: list[int], clock: Clock) -> dict:
    payload = await clock.time("export", engines.source.export_kv(input_ids=ids[:-1]))
    await clock.time("import", engines.target.import_kv(payload))
    result = await clock.time("generate", engines.target.generate(
        GenerateRequest(input_ids=ids, sampling_params=GREEDY_ONE)))
    return {"next_token": result.output_ids[0], "cached_tokens": result.cached_tokens,
            "payload_bytes": len(payload.data)}


async def kv_staged(engines: Engines, ids: list[int], clock: Clock) -> dict:
    payload = await clock.time("export", engines.source.export_kv(input_ids=ids[:-1]))
    staged = await clock.time("stage", engines.target.stage_kv(payload))

    async def resume() -> tuple[list[int], int | None]:
        output_ids, cached = [], None
        request = GenerateRequest(input_ids=ids, sampling_params=GREEDY_ONE)
        async for chunk in engines.target.generate_staged_stream(request, staged):
            output_ids += chunk.output_ids
            cached = chunk.cached_tokens if chunk.cached_tokens is not None else cached
        return output_ids, cached

    output_ids, cached = await clock.time("generate_staged", resume())
    return {"next_token": output_ids[0], "cached_tokens": cached,
            "payload_bytes": len(payload.data)}


ARM_RUNS = {"re_prefill": re_prefill, "kv_import": kv_import, "kv_staged": kv_staged}


async def one_run(engines: Engines, arm: str, length: int) -> dict:
    """One arm at one length, on the flushed target; the calls' times and what came back."""
    await engines.target.flush_cache()
    clock = Clock()
    run = await ARM_RUNS[arm](engines, session_ids(length), clock)
    last = list(clock.calls_ms)[-1]
    pause_ms = sum(clock.calls_ms.values()) if arm == "re_prefill" else clock.calls_ms[last]
    return {"arm": arm, "context_tokens": length, "ms": sum(clock.calls_ms.values()),
            "pause_ms": pause_ms, "calls_ms": clock.calls_ms, **run}


async def warm_source(source: SGLangDriver, contexts: list[int]) -> None:
    """Every session into the source's prefix cache (this prefill belongs to no arm)."""
    for length in contexts:
        await source.generate(GenerateRequest(input_ids=session_ids(length),
                                              sampling_params=GREEDY_ONE))


async def measure(model_dir: Path, contexts: list[int], num_reps: int) -> list[dict]:
    launcher = BuiltinLauncher(overrides={"num_threads": 1, "cache_bytes": CACHE_BYTES})
    rows = []
    async with launch_engine(launcher, model_dir) as first, \
            launch_engine(launcher, model_dir) as second, \
            SGLangDriver(first.url) as source, SGLangDriver(second.url) as target:
        engines = Engines(source, target)
        await warm_source(source, contexts)
        for rep in range(num_reps):
            arms = ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]
            for length in contexts:
                for arm in arms:
                    run = {**await one_run(engines, arm, length), "rep": rep}
                    print(json.dumps(run), flush=True)
                    rows.append(run)
    return rows


def summarize(rows: list[dict], contexts: list[int]) -> list[dict]:
    """Per length: each arm's median time and pause, its ratio to re-prefill, the payload,
    and whether every run of every arm gave the same next token."""
    table = []
    for length in contexts:
        runs = [r for r in rows if r["context_tokens"] == length]
        entry: dict = {"context_tokens": length,
                       "same_next_token": len({r["next_token"] for r in runs}) == 1}
        for arm in ARMS:
            mine = [r for r in runs if r["arm"] == arm]
            entry[f"{arm}_ms"] = statistics.median(r["ms"] for r in mine)
            entry[f"{arm}_pause_ms"] = statistics.median(r["pause_ms"] for r in mine)
            entry[f"{arm}_cached_tokens"] = mine[0]["cached_tokens"]
            for call in mine[0]["calls_ms"]:
                entry[f"{arm}_{call}_ms"] = statistics.median(r["calls_ms"][call] for r in mine)
        entry["payload_bytes"] = next(r["payload_bytes"] for r in runs if r["payload_bytes"])
        for arm in ARMS[1:]:
            entry[f"re_prefill_over_{arm}"] = entry["re_prefill_ms"] / entry[f"{arm}_ms"]
            entry[f"re_prefill_over_{arm}_pause"] = (entry["re_prefill_pause_ms"]
                                                     / entry[f"{arm}_pause_ms"])
        table.append(entry)
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| context | re-prefill | KV import: export + import + generate | ratio | "
             "KV staged: export + stage + generate_staged | ratio | "
             "pause ratio, staged | KV payload | same next token |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for e in table:
        lines.append(
            f"| {e['context_tokens']:,} | {e['re_prefill_ms']:,.0f} ms | "
            f"{e['kv_import_ms']:,.0f} ms ({e['kv_import_export_ms']:.0f} + "
            f"{e['kv_import_import_ms']:.0f} + {e['kv_import_generate_ms']:.0f}) | "
            f"{e['re_prefill_over_kv_import']:.1f}x | "
            f"{e['kv_staged_ms']:,.0f} ms ({e['kv_staged_export_ms']:.0f} + "
            f"{e['kv_staged_stage_ms']:.0f} + {e['kv_staged_generate_staged_ms']:.0f}) | "
            f"{e['re_prefill_over_kv_staged']:.1f}x | "
            f"{e['re_prefill_over_kv_staged_pause']:,.0f}x | "
            f"{e['payload_bytes'] / 2**20:.1f} MiB | "
            f"{'yes' if e['same_next_token'] else 'NO'} |")
    return "\n".join(lines)


def write_results(out: Path, model: str, model_dir: Path, rows: list[dict], table: list[dict],
                  load_before: tuple[float, ...], wall_s: float) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "model": model, "engine": {"num_threads": 1, "dtype": "float32"},
        "kv_bytes_per_token": ModelConfig.from_dir(model_dir).kv_bytes_per_token,
        "wall_s": wall_s, "table": table, "runs": rows}, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every arm")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a model directory to serve (default: the tiny model, built here)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    load_before, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="undertow-bench-migration-cost-") as work_dir:
        model_dir = args.model_dir
        if model_dir is None:
            from undertow.learner.modeldir import init_model_dir

            model_dir = init_model_dir(Path(work_dir) / "tiny", size="tiny", seed=0)
        rows = asyncio.run(measure(model_dir, contexts, args.reps))
        table = summarize(rows, contexts)
        write_results(args.out, "tiny" if args.model_dir is None else str(args.model_dir),
                      model_dir, rows, table, load_before, time.perf_counter() - started)
    print(markdown(table))


if __name__ == "__main__":
    main()
