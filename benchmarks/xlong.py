"""xLong-horizon benchmark: a million-token session end to end, in bounded memory.

    python -m benchmarks.xlong [--calls 500] [--path-tokens 24576] [--long-path-tokens 131072]
        [--max-rss-gib 12] [--probe-tokens 24576,49152] [--long-measure full|probes]
        [--growing-calls 500] [--growing-command-tokens 100]
        [--parts session,growing,learner,long]

(a) Gateway (`xlong_session.py`): one session of 500 calls and about 1M tokens, its
    history condensed about every 95k tokens, through `undertow gateway serve` in front
    of the scripted engine: the gateway's CPU and latency per call at calls 10, 100 and
    500 (each the 10th call of its condensation cycle, so the same request size), its
    RSS over the session, and the store's bytes against the tree's unique tokens.
(d) Un-condensed (`xlong_growing.py`, `--parts growing`): one tool-calling session that
    re-sends its whole history every call, about 2,000 tokens more each time (1M at call
    500), through the gateway and, byte for byte, through the bare relay
    (`benchmarks/bare_relay.py`) in the same run: CPU per call of each at the first and
    the last calls, the gateway's own work (its CPU minus the relay's) from call 11-30 to
    the last 20, token truth on every call. Targets: at the end the gateway's CPU per
    call at most 1.2x the relay's, its own work flat within 1.5x. With
    `--growing-command-tokens` each reply streams that many tokens (+~25) instead of
    ~125: two short runs apart give the cost of a streamed token at each proxy.
(b) Learner (`xlong_learner.py`): peak memory and time of one step, LM head chunked (and
    long micro-batches in segments) vs unchunked, for a group of such sessions (scaled
    to this CPU), one long path, and the LM head alone at a 128k-token path's shape.

(c) Long path (`xlong_learner.run_long`): one step over a single 128k-token path, the
    LM head chunked (in segments) measured at full length, and unchunked, measured too
    if its peak fits in `--max-rss-gib`, else extrapolated from paths of 24k and 48k.
    Attention over 128k positions is about half an hour of CPU per variant on the tiny
    model (~1.5e14 FLOPs forward and backward); `--parts session,learner` leaves it out.

Writes benchmarks/results/xlong.json (the parts run replace theirs, the others are
kept) and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from benchmarks import xlong_growing, xlong_learner, xlong_session

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


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def learner_table(rows: list[dict]) -> str:
    lines = ["| case | LM head | tokens (unique / packed) | terms | micro-batches (longest) "
             "| step CPU s | step wall s | peak step MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        variant = row["variant"]
        if "extrapolated_from" in row:
            variant += ", extrapolated from " + " and ".join(
                f"{t // 1000}k" for t in row["extrapolated_from"])
        tokens = (f"{row['num_unique_tokens']:,} / {row['num_packed_tokens']:,}"
                  if "num_unique_tokens" in row else f"V = {row['vocab_size']:,}")
        batches = (f"{row['num_micro_batches']} ({row['longest_micro_batch']:,})"
                   if "num_micro_batches" in row else "n/a")
        lines.append(f"| {row['case']} | {variant} | {tokens} | {row['num_terms']:,} | "
                     f"{batches} | {row['step_cpu_s']:.1f} | {_seconds(row['step_s'])} | "
                     f"{row['peak_step_mib']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=xlong_session.NUM_CALLS)
    parser.add_argument("--path-tokens", type=int, default=24576)
    parser.add_argument("--long-path-tokens", type=int, default=131072)
    parser.add_argument("--max-rss-gib", type=float, default=12.0)
    parser.add_argument("--probe-tokens", help="two shorter paths, e.g. 24576,49152")
    parser.add_argument("--long-measure", choices=["full", "probes"], default="full")
    parser.add_argument("--parts", default="session,growing,learner,long")
    parser.add_argument("--growing-calls", type=int, default=xlong_growing.NUM_CALLS)
    parser.add_argument("--growing-command-tokens", type=int,
                        default=xlong_growing.COMMAND_TOKENS)
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
    results: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = init_model_dir(Path(scratch) / "tiny", size="tiny", seed=0)
        if "session" in parts:
            print("(a) one session at the gateway", flush=True)
            results["session"] = asyncio.run(
                xlong_session.run_session(model_dir, Path(scratch), args.calls))
            _write(results)
        if "growing" in parts:
            print("(d) one session, its history never condensed", flush=True)
            key = ("growing" if args.growing_command_tokens == xlong_growing.COMMAND_TOKENS
                   else f"growing_{args.growing_command_tokens}_command_tokens")
            results[key] = asyncio.run(
                xlong_growing.run_growing(model_dir, Path(scratch), args.growing_calls,
                                          args.growing_command_tokens))
            _write(results)
        if "learner" in parts:
            print("(b) learner steps", flush=True)
            results["path_tokens"] = args.path_tokens
            results["learner"] = xlong_learner.run_all(model_dir, args.path_tokens,
                                                       args.timeout_s)
            _write(results)
        if "long" in parts:
            print(f"(c) one {args.long_path_tokens:,}-token path", flush=True)
            results["long_path_tokens"] = args.long_path_tokens
            probes = (tuple(int(t) for t in args.probe_tokens.split(","))
                      if args.probe_tokens else None)
            results["long_path"] = xlong_learner.run_long(
                model_dir, args.long_path_tokens, args.timeout_s, args.max_rss_gib, probes,
                args.long_measure)
            _write(results)
    if "session" in results:
        print(session_table(results["session"]))
    for key in results:
        if key.startswith("growing"):
            print(xlong_growing.growing_table(results[key]))
    for part in ("learner", "long_path"):
        if part in results:
            print(learner_table(results[part]))


def _write(results: dict) -> None:
    """Writes the parts run, keeping the others' last results."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    kept = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.write_text(json.dumps({**kept, **results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
