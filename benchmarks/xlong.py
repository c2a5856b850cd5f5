"""xLong-horizon benchmark: a million-token session end to end, in bounded memory.

    python -m benchmarks.xlong [--calls 500] [--path-tokens 24576] [--parts session,learner]

(a) Gateway (`xlong_session.py`): one session of 500 calls and about 1M tokens, its
    history condensed about every 95k tokens, through `undertow gateway serve` in front
    of the scripted engine: the gateway's CPU and latency per call at calls 10, 100 and
    500 (each the 10th call of its condensation cycle, so the same request size), its
    RSS over the session, and the store's bytes against the tree's unique tokens.
(b) Learner (`xlong_learner.py`): peak memory and time of one step, LM head chunked (and
    long micro-batches in segments) vs unchunked, for a group of such sessions (scaled
    to this CPU), one long path, and the LM head alone at a 128k-token path's shape.

The 128k-token path itself costs about half an hour of CPU per variant on the tiny
model (attention over 128k positions: ~1.5e14 FLOPs forward and backward), more than
this benchmark's budget on a shared 2-core machine, so the default long path is 24k
tokens; `--path-tokens 131072` runs the full length. Writes benchmarks/results/xlong.json
and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from benchmarks import xlong_learner, xlong_session

RESULTS = Path(__file__).resolve().parent / "results" / "xlong.json"


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def session_table(result: dict) -> str:
    summary = result["summary"]
    lines = ["| call | prompt tokens | gateway CPU ms (call; p50 of k-4..k) "
             "| latency ms (call; p50 of k-4..k) |", "|---:|---:|---:|---:|"]
    for call, row in summary["at_call"].items():
        lines.append(f"| {call} | {row['prompt_tokens']:,} | {row['cpu_ms']:.2f}; "
                     f"{row['cpu_ms_window_p50']:.2f} | {row['wall_ms']:.2f}; "
                     f"{row['wall_ms_window_p50']:.2f} |")
    lines += ["", f"Call 500 vs call 10 (p50 of the windows): CPU "
              f"{summary['cpu_ratio_500_vs_10']:.2f}x, latency "
              f"{summary['wall_ratio_500_vs_10']:.2f}x. "
              f"{summary['num_calls']} calls, {summary['num_condensations']} condensations, "
              f"{summary['total_prompt_tokens']:,} prompt tokens sent, longest prompt "
              f"{summary['max_prompt_tokens']:,}; {summary['unique_tokens']:,} unique tokens in "
              f"the tree.", "",
              "| after call | unique tokens | gateway RSS | store on disk "
              "| store bytes per unique token |",
              "|---:|---:|---:|---:|---:|"]
    samples = result["samples"]
    for sample in samples[1::10] + ([samples[-1]] if (len(samples) - 2) % 10 else []):
        per_token = sample["store_bytes"] / max(1, sample["unique_tokens"])
        lines.append(f"| {sample['call']} | {sample['unique_tokens']:,} | "
                     f"{_mib(sample['rss_bytes'])} | {_mib(sample['store_bytes'])} | "
                     f"{per_token:.2f} |")
    lines += ["", f"RSS growth per unique token (call 10 to the end): "
              f"{summary['rss_bytes_per_unique_token']:.1f} bytes."]
    return "\n".join(lines)


def learner_table(rows: list[dict]) -> str:
    lines = ["| case | LM head | tokens (unique / packed) | terms | micro-batches (longest) "
             "| step CPU s | step wall s | peak step MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        tokens = (f"{row['num_unique_tokens']:,} / {row['num_packed_tokens']:,}"
                  if "num_unique_tokens" in row else f"V = {row['vocab_size']:,}")
        batches = (f"{row['num_micro_batches']} ({row['longest_micro_batch']:,})"
                   if "num_micro_batches" in row else "n/a")
        lines.append(f"| {row['case']} | {row['variant']} | {tokens} | {row['num_terms']:,} | "
                     f"{batches} | {row['step_cpu_s']:.1f} | {row['step_s']:.1f} | "
                     f"{row['peak_step_mib']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=xlong_session.NUM_CALLS)
    parser.add_argument("--path-tokens", type=int, default=24576)
    parser.add_argument("--parts", default="session,learner")
    parser.add_argument("--timeout-s", type=int, default=3600)
    parser.add_argument("--worker", choices=["group", "path", "head"])
    parser.add_argument("--variant", choices=sorted(xlong_learner.VARIANTS))
    parser.add_argument("--model-dir")
    args = parser.parse_args(argv)
    if args.worker:
        xlong_learner.worker_main(args.worker, args.variant, args.model_dir, args.path_tokens)
        return
    from undertow.learner.modeldir import init_model_dir

    parts = args.parts.split(",")
    results: dict = {"path_tokens": args.path_tokens}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = init_model_dir(Path(scratch) / "tiny", size="tiny", seed=0)
        if "session" in parts:
            print("(a) one session at the gateway", flush=True)
            results["session"] = asyncio.run(
                xlong_session.run_session(model_dir, Path(scratch), args.calls))
            _write(results)
        if "learner" in parts:
            print("(b) learner steps", flush=True)
            results["learner"] = xlong_learner.run_all(model_dir, args.path_tokens,
                                                       args.timeout_s)
            _write(results)
    if "session" in results:
        print(session_table(results["session"]))
    if "learner" in results:
        print(learner_table(results["learner"]))


def _write(results: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
