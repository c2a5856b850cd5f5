"""Engine benchmark: the built-in engine and vLLM side by side, on the same model directories.

    python -m benchmarks.engine [--sizes tiny,small] [--engines builtin,vllm]
        [--dtype bfloat16|float32] [--threads 2]
    python -m benchmarks.engine --sizes qwen2.5-coder-0.5b-instruct --decode-tokens 16 \
        --results benchmarks/results/engine_qwen.json

For each model (a size built offline with `init_model_dir`, a model directory, or a pretrained
model fetched into `.cache/models/NAME` by `make setup-models`), both engines are started
(one after the other, through `gateway.engines.launch`) and measured in turns, never at the
same time: each round of each case runs on one engine while the other idles, then on the other
(the order rotating), so that on a shared machine they see the same load. Both are driven the
same way through `POST /v1/completions` with prompt token IDs, `ignore_eos` and greedy sampling,
both in the same dtype (`--dtype`: the built-in engine's `dtype`, vLLM's `--dtype`; bfloat16
by default, what CPU users serve) and on the same number of threads (`--threads`: the built-in
engine's `num_threads`, vLLM's `OMP_NUM_THREADS`):
- decode throughput: `c` concurrent requests (c = 1, 8, 32) of a 32-token prompt each generating
  128 tokens (`--decode-tokens`); output tokens / wall seconds, after a warm-up round; best of 3
  rounds (the same prompts on both engines);
- prefill time of a 2,000-token prompt (one output token): first uncached, then the same prompt
  again with its prefix cached; best of 3 distinct prompts.
Writes `benchmarks/results/engine.json` and prints a Markdown table with the ratios the engine
issues set as targets (c=32 / c=1 >= 8x; cached prefill >= 10x faster; issue 27: built-in
decode >= 1.0x vLLM's at every concurrency, uncached 2k prefill <= 1.3x vLLM's time).
Wall-clock numbers on a shared machine are noisy: compare within one run.

    python -m benchmarks.engine --case itl [--size tiny] [--chunk-sizes 0,256] [--threads 1]

The inter-token-latency case (built-in engine only, one engine per chunk size, `0` being
chunked prefill off): 16 sessions decode (streamed `/generate`, greedy); once each has 16
tokens, a 16,384-token prompt arrives (one output token). The running sessions' inter-token
latencies (gap between two streamed events over the tokens the later one brought) are taken
from its arrival until each session has 16 more tokens after its prefill; p50, p99 and max,
with the p50 before the arrival for reference and the long prompt's time to its token.
Writes `benchmarks/results/engine_itl.json`.
"""

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import aiohttp

from undertow.gateway.engines.launch import BuiltinLauncher, VLLMLauncher, launch_engine

CONCURRENCIES = (1, 8, 32)
PROMPT_TOKENS = 32
DECODE_TOKENS = 128
PREFILL_TOKENS = 2000
NUM_ROUNDS = 3  # best of: the machine is shared, and other work only ever slows a round
TOKEN_RANGE = (3, 2700)
RESULTS = Path(__file__).parent / "results" / "engine.json"
TIMEOUT = aiohttp.ClientTimeout(total=1800)


def token_ids(seed: int, length: int) -> list[int]:
    return random.Random(seed).choices(range(*TOKEN_RANGE), k=length)


async def complete(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                   max_tokens: int) -> tuple[int, float]:
    """One greedy completion; (completion tokens, seconds)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as reply:
        payload = await reply.json()
        if reply.status != 200:
            raise RuntimeError(f"{url} answered {reply.status}: {payload}")
    return payload["usage"]["completion_tokens"], time.perf_counter() - started


async def decode_round(session, url: str, model: str, prompts: list[list[int]],
                       decode_tokens: int) -> float:
    """Output tokens per second of `prompts` sent at once."""
    started = time.perf_counter()
    results = await asyncio.gather(*(complete(session, url, model, p, decode_tokens)
                                     for p in prompts))
    return sum(num_tokens for num_tokens, _ in results) / (time.perf_counter() - started)


def in_turns(engines: dict[str, str], round_index: int) -> list[tuple[str, str]]:
    """The engines in the order of this round: rotated each round, so none always goes first."""
    items = list(engines.items())
    shift = round_index % len(items)
    return items[shift:] + items[:shift]


async def measure(engines: dict[str, str], model: str, seed: int, decode_tokens: int) -> dict:
    """Every case on every engine (name -> URL), in turns: each round of a case runs on one
    engine while the others idle, the next round of that case on the next engine, so that on
    a shared machine they see the same load. Decode throughput is the best of NUM_ROUNDS
    rounds, prefill the least of NUM_ROUNDS distinct prompts (uncached, then again cached)."""
    results = {name: {"decode_tokens_per_s": {}, "prefill_2000_s": {}, "load_average_1m": []}
               for name in engines}

    def note_load(name: str) -> None:
        results[name]["load_average_1m"].append(round(os.getloadavg()[0], 2))

    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for url in engines.values():
            await complete(session, url, model, token_ids(1, 64), 4)
        for c in CONCURRENCIES:
            warm_up = [token_ids(1000 * c + i, PROMPT_TOKENS) for i in range(c)]
            for url in engines.values():
                await asyncio.gather(*(complete(session, url, model, p, 8) for p in warm_up))
            rates: dict[str, list[float]] = {name: [] for name in engines}
            for round_index in range(NUM_ROUNDS):
                prompts = [token_ids(100_000 * (round_index + 1) + 1000 * c + i, PROMPT_TOKENS)
                           for i in range(c)]
                for name, url in in_turns(engines, round_index):
                    rates[name].append(await decode_round(session, url, model, prompts,
                                                          decode_tokens))
                    note_load(name)
            for name in engines:
                results[name]["decode_tokens_per_s"][c] = max(rates[name])
        seconds = {name: {"uncached": [], "cached": []} for name in engines}
        for round_index in range(NUM_ROUNDS):
            prompt = token_ids(seed + round_index, PREFILL_TOKENS)
            for name, url in in_turns(engines, round_index):
                for kind in ("uncached", "cached"):
                    seconds[name][kind].append((await complete(session, url, model, prompt,
                                                               1))[1])
                note_load(name)
        for name in engines:
            results[name]["prefill_2000_s"] = {kind: min(values)
                                               for kind, values in seconds[name].items()}
    return results


ITL_SESSIONS = 16
ITL_SESSION_PROMPT = 32
ITL_LONG_PROMPT = 16384
ITL_MARGIN_TOKENS = 16  # tokens each session makes before the arrival, and after its prefill
ITL_RESULTS = Path(__file__).parent / "results" / "engine_itl.json"


class TokenTimes:
    """When each streamed event of one session arrived, and its cumulative token count."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int]] = []
        self.grew = asyncio.Event()

    def count(self) -> int:
        return self.events[-1][1] if self.events else 0

    def gaps(self, since: float) -> list[float]:
        """Per-token latencies (seconds) of the events after `since`."""
        out = []
        for (before_at, before), (at, now) in zip(self.events, self.events[1:], strict=False):
            if at > since and now > before:
                out += [(at - before_at) / (now - before)] * (now - before)
        return out


async def stream_session(session, url: str, rid: str, prompt: list[int],
                         times: TokenTimes) -> None:
    body = {"input_ids": prompt, "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 30_000, "temperature": 0.0,
                                "ignore_eos": True}}
    async with session.post(url + "/generate", json=body) as reply:
        async for line in reply.content:
            if line.startswith(b"data: {"):
                count = json.loads(line[6:])["meta_info"]["completion_tokens"]
                times.events.append((time.perf_counter(), count))
                times.grew.set()


async def wait_for_tokens(sessions: list[TokenTimes], targets: list[int]) -> None:
    for times, target in zip(sessions, targets, strict=True):
        while times.count() < target:
            times.grew.clear()
            await times.grew.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure_itl(model_dir: Path, chunk_size: int, threads: int | None,
                      dtype: str) -> dict:
    launcher = BuiltinLauncher(overrides={**builtin_overrides(threads, dtype),
                                          "chunked_prefill_size": chunk_size})
    async with launch_engine(launcher, model_dir) as engine, aiohttp.ClientSession(
            timeout=TIMEOUT) as session:
        sessions = [TokenTimes() for _ in range(ITL_SESSIONS)]
        tasks = [asyncio.create_task(stream_session(
            session, engine.url, f"itl-{i}", token_ids(500 + i, ITL_SESSION_PROMPT), times))
            for i, times in enumerate(sessions)]
        await wait_for_tokens(sessions, [ITL_MARGIN_TOKENS] * ITL_SESSIONS)
        arrived = time.perf_counter()
        before = [g for times in sessions for g in times.gaps(0.0)]
        await complete(session, engine.url, str(model_dir), token_ids(7, ITL_LONG_PROMPT), 1)
        prefilled = time.perf_counter()
        await wait_for_tokens(sessions, [t.count() + ITL_MARGIN_TOKENS for t in sessions])
        for i in range(ITL_SESSIONS):
            async with session.post(engine.url + "/abort_request", json={"rid": f"itl-{i}"}):
                pass
        await asyncio.gather(*tasks)
    during = [g for times in sessions for g in times.gaps(arrived)]
    return {"chunked_prefill_size": chunk_size, "num_latencies": len(during),
            "p50_ms": 1000 * percentile(during, 0.5), "p99_ms": 1000 * percentile(during, 0.99),
            "max_ms": 1000 * max(during), "p50_before_ms": 1000 * percentile(before, 0.5),
            "long_prompt_s": prefilled - arrived}


def itl_markdown(rows: list[dict]) -> str:
    lines = ["| chunked prefill | p50 ms | p99 ms | max ms | p99/p50 | p50 before arrival ms | "
             "16k prompt s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = "off" if r["chunked_prefill_size"] <= 0 else str(r["chunked_prefill_size"])
        lines.append(f"| {name} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['max_ms']:.0f} | "
                     f"{r['p99_ms'] / r['p50_ms']:.1f}x | {r['p50_before_ms']:.0f} | "
                     f"{r['long_prompt_s']:.1f} |")
    return "\n".join(lines)


async def run_itl(size: str, chunk_sizes: list[int], threads: int | None, dtype: str,
                  work_dir: Path) -> list[dict]:
    from undertow.learner.modeldir import init_model_dir

    model_dir = init_model_dir(work_dir / size, size=size, seed=0)
    rows = []
    for chunk_size in chunk_sizes:
        rows.append(await measure_itl(model_dir, chunk_size, threads, dtype))
        print(f"measured chunked_prefill_size={chunk_size}: {rows[-1]}", flush=True)
    return rows


def main_itl(args) -> None:
    with tempfile.TemporaryDirectory(prefix="undertow-bench-itl-") as work_dir:
        rows = asyncio.run(run_itl(args.size, [int(c) for c in args.chunk_sizes.split(",")],
                                   args.threads or None, args.dtype, Path(work_dir)))
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_average_1m": os.getloadavg()[0]},
              "settings": {"size": args.size, "sessions": ITL_SESSIONS,
                           "session_prompt_tokens": ITL_SESSION_PROMPT,
                           "long_prompt_tokens": ITL_LONG_PROMPT,
                           "margin_tokens": ITL_MARGIN_TOKENS,
                           "threads": args.threads, "dtype": args.dtype},
              "results": rows}
    ITL_RESULTS.parent.mkdir(parents=True, exist_ok=True)
    ITL_RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(itl_markdown(rows))


def builtin_overrides(threads: int | None, dtype: str) -> dict:
    """The built-in engine's `dtype`, and its `num_threads` when one is asked for (None:
    torch's default)."""
    return {"dtype": dtype, **({"num_threads": threads} if threads else {})}


def launchers(names: list[str], threads: int | None, dtype: str) -> dict:
    """Both engines in `dtype` on `threads` threads each (None: each engine's default)."""
    available = {
        "builtin": BuiltinLauncher(overrides=builtin_overrides(threads, dtype)),
        "vllm": VLLMLauncher(max_model_len=4096, dtype=dtype, extra_env=(
            {"OMP_NUM_THREADS": str(threads)} if threads else {})),
    }
    return {name: available[name] for name in names}


def ratios(results: dict) -> dict:
    out = {}
    for size, engines in results.items():
        for name, r in engines.items():
            tps, prefill = r["decode_tokens_per_s"], r["prefill_2000_s"]
            out[f"{size}/{name}/c32_over_c1"] = tps[32] / tps[1]
            out[f"{size}/{name}/prefill_cached_speedup"] = prefill["uncached"] / prefill["cached"]
        if "builtin" in engines and "vllm" in engines:
            for c in CONCURRENCIES:
                out[f"{size}/builtin_over_vllm/c{c}"] = (
                    engines["builtin"]["decode_tokens_per_s"][c]
                    / engines["vllm"]["decode_tokens_per_s"][c])
            # A time, not a rate: below 1 the built-in engine prefills faster.
            out[f"{size}/builtin_over_vllm/prefill_uncached_time"] = (
                engines["builtin"]["prefill_2000_s"]["uncached"]
                / engines["vllm"]["prefill_2000_s"]["uncached"])
    return out


def markdown(results: dict, ratio_values: dict) -> str:
    lines = ["| model | engine | c=1 tok/s | c=8 tok/s | c=32 tok/s | c=32/c=1 | "
             "prefill 2k uncached s | cached s | cached speedup |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for size, engines in results.items():
        for name, r in engines.items():
            tps, prefill = r["decode_tokens_per_s"], r["prefill_2000_s"]
            lines.append(
                f"| {size} | {name} | {tps[1]:.0f} | {tps[8]:.0f} | {tps[32]:.0f} | "
                f"{tps[32] / tps[1]:.1f}x | {prefill['uncached']:.3f} | {prefill['cached']:.3f} | "
                f"{prefill['uncached'] / prefill['cached']:.1f}x |")
    versus = [f"- {key.split('/')[0]} built-in / vLLM at {key.split('/')[-1]}: {value:.2f}x"
              for key, value in ratio_values.items() if "builtin_over_vllm" in key]
    return "\n".join(lines + ([""] + versus if versus else []))


MODELS_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "models"


def model_dir_of(name: str, work_dir: Path) -> Path:
    """A size of `init_model_dir`, built in `work_dir`; else a model directory, given as a path
    or as the name of a pretrained model in `.cache/models`."""
    from undertow.learner.modeldir import SIZES, init_model_dir

    if name in SIZES:
        return init_model_dir(work_dir / name, size=name, seed=0)
    for path in (Path(name), MODELS_CACHE / name):
        if (path / "config.json").exists():
            return path
    raise SystemExit(f"{name}: neither a size ({', '.join(sorted(SIZES))}) nor a model "
                     f"directory; `make setup-models` fetches the pretrained ones")


async def run(sizes: list[str], engine_names: list[str], threads: int | None, dtype: str,
              work_dir: Path, decode_tokens: int) -> dict:
    """Per model: start the engines one after the other (starting is the heavy part), then
    `measure` them in turns."""
    results: dict = {}
    for index, size in enumerate(sizes):
        model_dir = model_dir_of(size, work_dir)
        async with contextlib.AsyncExitStack() as stack:
            engines = {name: (await stack.enter_async_context(launch_engine(launcher,
                                                                            model_dir))).url
                       for name, launcher in launchers(engine_names, threads, dtype).items()}
            results[size] = await measure(engines, str(model_dir), seed=10_000 * (index + 1),
                                          decode_tokens=decode_tokens)
        print(f"measured {size}: {results[size]}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small",
                        help="sizes, model directories or pretrained names (.cache/models)")
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS,
                        help="tokens each decode request generates")
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON file to write")
    parser.add_argument("--engines", default="builtin,vllm")
    parser.add_argument("--threads", type=int, default=2,
                        help="threads of each engine: the built-in engine's num_threads, "
                             "vLLM's OMP_NUM_THREADS (0: each engine's default)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the dtype both engines load and compute in")
    parser.add_argument("--case", choices=("throughput", "itl"), default="throughput")
    parser.add_argument("--size", default="tiny", help="model size of the itl case")
    parser.add_argument("--chunk-sizes", default="0,256",
                        help="chunked prefill sizes of the itl case (0: off)")
    args = parser.parse_args()
    if args.case == "itl":
        main_itl(args)
        return
    with tempfile.TemporaryDirectory(prefix="undertow-bench-engine-") as work_dir:
        results = asyncio.run(run(args.sizes.split(","), args.engines.split(","),
                                  args.threads or None, args.dtype, Path(work_dir),
                                  args.decode_tokens))
    ratio_values = ratios(results)
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_average_1m": os.getloadavg()[0]},
              "settings": {"concurrencies": CONCURRENCIES, "prompt_tokens": PROMPT_TOKENS,
                           "threads": args.threads, "dtype": args.dtype,
                           "decode_tokens": args.decode_tokens,
                           "prefill_tokens": PREFILL_TOKENS},
              "results": results, "ratios": ratio_values}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(report, indent=2) + "\n")
    print(f"Both engines in {args.dtype}, {args.threads or 'default'} threads each.")
    print(markdown(results, ratio_values))


if __name__ == "__main__":
    main()
