"""Behaviour logprobs against cache state (issue 36, item 6): how far the logprobs an engine
records for the same tokens move with what its prefix cache held, and how that compares with
the train/sample mismatch the learner sees (`learner/mismatch.py`).

    python -m benchmarks.cache_logprobs [--models tiny,smollm2-135m-instruct]
                                        [--dtypes float32,bfloat16] [--lengths 64,512,2048]

Per model and dtype, two built-in engines (one torch thread each): `plain` (the default
config: an idle engine prefills a prompt whole) and `chunked` (`chunked_prefill_size` and
`max_prefill_tokens` both `CHUNK_TOKENS`, so every prompt is prefilled in chunks). Prompts are
windows of the frozen corpus (`learner/modeldir/corpus.py`) through the model's tokenizer,
two per length. Each prompt P is run greedily for `NUM_TOKENS` tokens with logprobs, under
each condition:

- `cold`: on the flushed plain engine (the reference), and `cold_again` (the same, again:
  the engine's run-to-run noise);
- `cached`: P sent once before (max 1 token), so all of P but its last token is cached;
- `half_cached`: the first half of P cached;
- `chunked`: cold on the chunked engine;
- `kv_imported`: P's KV exported from the plain engine and imported into the flushed chunked
  one (`undertow_kv.py`), as a migration with KV transfer leaves it;
- `re_prefilled`: P plus the cold run's first half of the output sent to the flushed engine,
  as a migration or abort-resume without KV transfer leaves it (only the second half of the
  output is compared).

Drift: |logprob - the cold run's| per output token, while the output IDs agree with the cold
run's (a greedy flip ends the comparison for that prompt; the flips are counted). Beside it,
the train/sample mismatch: the learner's float32 logprobs (`PolicyModel.score_path`, the
model loaded as `undertow train` loads it) minus each condition's, the d_t of
`learner/mismatch.py`. Writes `benchmarks/results/cache_logprobs.json` (every prompt's
logprobs) and prints a Markdown table.
"""

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.engine import model_dir_of
from undertow.gateway.builtin_engine.tokenizer import Tokenizer
from undertow.gateway.engines.launch import BuiltinLauncher, launch_engine
from undertow.gateway.engines.protocol import GenerateRequest, GenerateResult, SamplingParams
from undertow.gateway.engines.sglang import SGLangDriver

RESULTS = Path(__file__).parent / "results" / "cache_logprobs.json"
NUM_TOKENS = 32
CHUNK_TOKENS = 32
PROMPTS_PER_LENGTH = 2
CONDITIONS = ("cold", "cold_again", "cached", "half_cached", "chunked", "kv_imported",
              "re_prefilled")


@dataclass(frozen=True)
class Engines:
    plain: SGLangDriver
    chunked: SGLangDriver


@dataclass(frozen=True)
class Outcome:
    """One condition's run of one prompt: the output IDs (NUM_TOKENS of them, a resume's
    with the cold run's first half in front), the logprob of each from `first` on (None
    before), and how many prompt tokens the engine reported cached."""

    output_ids: list[int]
    logprobs: list[float | None]
    first: int
    cached_tokens: int | None


async def generate(engine: SGLangDriver, ids: list[int], max_new_tokens: int) -> GenerateResult:
    return await engine.generate(GenerateRequest(
        input_ids=ids, return_logprob=True, sampling_params=SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)))


def outcome(result: GenerateResult, head: list[int] | None = None) -> Outcome:
    head = head or []
    return Outcome(head + result.output_ids,
                   [None] * len(head) + [lp for lp, _ in result.output_token_logprobs],
                   len(head), result.cached_tokens)


async def cold(engines: Engines, ids: list[int], _: Outcome | None) -> Outcome:
    await engines.plain.flush_cache()
    return outcome(await generate(engines.plain, ids, NUM_TOKENS))


async def cached(engines: Engines, ids: list[int], _: Outcome | None) -> Outcome:
    await engines.plain.flush_cache()
    await generate(engines.plain, ids, 1)
    return outcome(await generate(engines.plain, ids, NUM_TOKENS))


async def half_cached(engines: Engines, ids: list[int], _: Outcome | None) -> Outcome:
    await engines.plain.flush_cache()
    await generate(engines.plain, ids[:len(ids) // 2], 1)
    return outcome(await generate(engines.plain, ids, NUM_TOKENS))


async def chunked(engines: Engines, ids: list[int], _: Outcome | None) -> Outcome:
    await engines.chunked.flush_cache()
    return outcome(await generate(engines.chunked, ids, NUM_TOKENS))


async def kv_imported(engines: Engines, ids: list[int], _: Outcome | None) -> Outcome:
    await engines.plain.flush_cache()
    await generate(engines.plain, ids, 1)
    payload = await engines.plain.export_kv(input_ids=ids[:-1])
    await engines.chunked.flush_cache()
    await engines.chunked.import_kv(payload)
    return outcome(await generate(engines.chunked, ids, NUM_TOKENS))


async def re_prefilled(engines: Engines, ids: list[int], reference: Outcome | None) -> Outcome:
    assert reference is not None  # the cold run comes first
    head = reference.output_ids[:NUM_TOKENS // 2]
    await engines.plain.flush_cache()
    return outcome(await generate(engines.plain, ids + head, NUM_TOKENS - len(head)), head)


RUNS: dict[str, Callable[[Engines, list[int], Outcome | None], Awaitable[Outcome]]] = {
    "cold": cold, "cold_again": cold, "cached": cached, "half_cached": half_cached,
    "chunked": chunked, "kv_imported": kv_imported, "re_prefilled": re_prefilled}


def prompts_of(model_dir: Path, lengths: list[int]) -> list[list[int]]:
    """`PROMPTS_PER_LENGTH` windows of each length from the frozen corpus, tokenized."""
    from undertow.learner.modeldir.corpus import read_frozen_corpus

    ids = Tokenizer(model_dir).encode("\n\n".join(read_frozen_corpus()))
    needed = PROMPTS_PER_LENGTH * sum(lengths)
    if len(ids) < needed:
        raise SystemExit(f"the frozen corpus is {len(ids)} tokens; {PROMPTS_PER_LENGTH} "
                         f"prompts of each length of {lengths} need {needed}")
    prompts, offset = [], 0
    for length in lengths:
        for _ in range(PROMPTS_PER_LENGTH):
            prompts.append(ids[offset:offset + length])
            offset += length
    return prompts


def compared(reference: Outcome, other: Outcome) -> tuple[list[int], bool]:
    """The output positions where `other` has a logprob and its IDs so far agree with the
    reference's; whether its greedy output flipped away from the reference."""
    positions = []
    for index in range(other.first, NUM_TOKENS):
        if other.output_ids[:index + 1] != reference.output_ids[:index + 1]:
            return positions, True
        positions.append(index)
    return positions, False


class LearnerScores:
    """The learner's float32 logprobs of a sequence's output tokens, each sequence once."""

    def __init__(self, model_dir: Path):
        from undertow.learner.model import PolicyModel

        self.model = PolicyModel.load(model_dir, dtype=torch.float32)
        self._scores: dict[tuple[int, ...], list[float]] = {}

    def of(self, prompt: list[int], output_ids: list[int]) -> list[float]:
        key = tuple(prompt + output_ids)
        if key not in self._scores:
            token_ids = torch.tensor(key)                                # (T,)
            scored = torch.arange(len(prompt), len(key))                 # (N,)
            with torch.no_grad():
                self._scores[key] = self.model.score_path(token_ids, scored).logprobs.tolist()
        return self._scores[key]


async def run_prompts(engines: Engines, prompts: list[list[int]]) -> list[dict[str, Outcome]]:
    """Every condition of every prompt, the cold one first (the others compare with it)."""
    runs = []
    for ids in prompts:
        outcomes: dict[str, Outcome] = {}
        for condition in CONDITIONS:
            outcomes[condition] = await RUNS[condition](engines, ids, outcomes.get("cold"))
        runs.append(outcomes)
    return runs


async def measure_engines(model_dir: Path, dtype: str, prompts: list[list[int]]
                          ) -> list[dict[str, Outcome]]:
    plain = BuiltinLauncher(overrides={"num_threads": 1, "dtype": dtype})
    chunky = BuiltinLauncher(overrides={"num_threads": 1, "dtype": dtype,
                                        "chunked_prefill_size": CHUNK_TOKENS,
                                        "max_prefill_tokens": CHUNK_TOKENS})
    async with launch_engine(plain, model_dir) as first, \
            launch_engine(chunky, model_dir) as second, \
            SGLangDriver(first.url) as plain_client, SGLangDriver(second.url) as chunked_client:
        return await run_prompts(Engines(plain_client, chunked_client), prompts)


def condition_row(condition: str, prompts: list[list[int]], runs: list[dict[str, Outcome]],
                  learner: LearnerScores) -> dict:
    """Drift from the cold run and train/sample mismatch of one condition, over the prompts."""
    drifts, firsts, mismatches, flips = [], [], [], 0
    for ids, outcomes in zip(prompts, runs, strict=True):
        reference, mine = outcomes["cold"], outcomes[condition]
        positions, flipped = compared(reference, mine)
        flips += flipped
        drifts += [abs(mine.logprobs[i] - reference.logprobs[i]) for i in positions]
        if positions and positions[0] == mine.first:
            firsts.append(drifts[-len(positions)])
        scores = learner.of(ids, mine.output_ids)
        mismatches += [abs(scores[i] - mine.logprobs[i]) for i in range(mine.first, NUM_TOKENS)]
    return {"condition": condition, "num_compared": len(drifts),
            "drift_mean": sum(drifts) / max(len(drifts), 1), "drift_max": max(drifts, default=0),
            "first_token_drift_max": max(firsts, default=0), "num_flipped": flips,
            "mismatch_mean": sum(mismatches) / len(mismatches),
            "mismatch_max": max(mismatches),
            "cached_tokens": [outcomes[condition].cached_tokens for outcomes in runs]}


def measure(model: str, model_dir: Path, dtypes: list[str], lengths: list[int]) -> list[dict]:
    """The rows of one model: per dtype, per condition (`condition_row`)."""
    prompts = prompts_of(model_dir, lengths)
    learner = LearnerScores(model_dir)
    rows = []
    for dtype in dtypes:
        runs = asyncio.run(measure_engines(model_dir, dtype, prompts))
        for condition in CONDITIONS:
            row = {"model": model, "dtype": dtype,
                   **condition_row(condition, prompts, runs, learner)}
            print(json.dumps(row), flush=True)
            rows.append({**row, "runs": [
                {"prompt_tokens": len(ids), "output_ids": outcomes[condition].output_ids,
                 "logprobs": outcomes[condition].logprobs}
                for ids, outcomes in zip(prompts, runs, strict=True)]})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | engine dtype | condition | cached prompt tokens | drift from cold: "
             "mean / max (nat) | first token: max (nat) | greedy flips | train/sample "
             "mismatch: mean / max (nat) |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        cached = ", ".join(str(n) for n in r["cached_tokens"])
        lines.append(f"| {r['model']} | {r['dtype']} | {r['condition']} | {cached} | "
                     f"{r['drift_mean']:.2g} / {r['drift_max']:.2g} | "
                     f"{r['first_token_drift_max']:.2g} | {r['num_flipped']} | "
                     f"{r['mismatch_mean']:.2g} / {r['mismatch_max']:.2g} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2-135m-instruct",
                        help="sizes, model directories or pretrained names (.cache/models)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--lengths", default="64,512,2048", help="prompt lengths, in tokens")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the learner's scoring: a shared machine
    lengths = [int(n) for n in args.lengths.split(",")]
    load_before, started = os.getloadavg(), time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="undertow-bench-cache-logprobs-") as work_dir:
        for model in args.models.split(","):
            rows += measure(model, model_dir_of(model, Path(work_dir)),
                            args.dtypes.split(","), lengths)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "num_tokens": NUM_TOKENS, "chunk_tokens": CHUNK_TOKENS, "prompt_lengths": lengths,
        "prompts_per_length": PROMPTS_PER_LENGTH, "learner_dtype": "float32",
        "wall_s": time.perf_counter() - started, "rows": rows}, indent=2) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
