"""`undertow eval`: pass@1 and pass@k of one or two checkpoints on a task set.

It runs the scaffold through `undertow rollout`'s embedded engine and gateway
(`undertow/run/rollout.py`), or scores finished rollout runs (`--from-run`), and reports
with `undertow/evaluation.py`, which states the estimators and intervals.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from undertow.commands import Commands, docker_url_from_env


def add(commands: Commands) -> None:
    command = commands.add_parser("eval", help="pass@1 and pass@k of checkpoints on a task "
                                  "set, with intervals and a paired comparison")
    command.add_argument("--tasks", type=Path, default=None,
                         help="tasks.jsonl, a folder holding one, or a local dataset")
    command.add_argument("--scaffold", default="mini-swe-agent")
    command.add_argument("--model", type=Path, action="append", default=[],
                         help="model directory (give two to compare checkpoints)")
    command.add_argument("-k", type=int, default=1, help="the k of pass@k")
    command.add_argument("--samples", type=int, default=None,
                         help="sessions per task (default k; more narrows the estimate)")
    command.add_argument("--from-run", type=Path, action="append", default=[],
                         help="score this finished rollout run instead (give two to compare)")
    command.add_argument("--concurrency", type=int, default=1)
    command.add_argument("--timeout-s", type=float, default=600.0)
    command.add_argument("--out", type=Path, default=Path("runs/eval"))
    command.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                         help="scaffold option, as for `undertow rollout`")
    command.set_defaults(handler=_eval)


def _summaries(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    from undertow.exports import read_summary

    if args.from_run:
        return [(run.name, read_summary(run)) for run in args.from_run]
    if not args.tasks or not args.model:
        raise ValueError("give --tasks and --model (or --from-run RUN)")
    import asyncio

    import yaml

    from undertow.run.rollout import RolloutCommand, run_rollout

    options = {}
    for option in args.option:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"--option {option!r} is not KEY=VALUE")
        options[key] = yaml.safe_load(value) if key != "command" else value
    results = []
    for model in args.model:
        command = RolloutCommand(
            tasks=args.tasks, scaffold=args.scaffold, group_size=args.samples or args.k,
            concurrency=args.concurrency, timeout_s=args.timeout_s, model_dir=model,
            out_dir=args.out, scaffold_options=options, docker_url=docker_url_from_env())
        results.append((model.name, asyncio.run(run_rollout(command)).to_json()))
    return results


def _eval(args: argparse.Namespace) -> int:
    from undertow.evaluation import compare, evaluate, format_comparison, format_result, outcomes

    summaries = _summaries(args)
    if len(summaries) > 2:
        raise ValueError("give at most two checkpoints (or runs) to compare")
    results = []
    for label, summary in summaries:
        per_task, num_left_out = outcomes(summary)
        results.append(evaluate(per_task, args.k, label, num_left_out))
        print(format_result(results[-1]) + "\n")
    report: dict[str, Any] = {"results": [result.to_json() for result in results]}
    if len(results) == 2:
        comparison = compare(*results)
        print(format_comparison(comparison))
        report["comparison"] = comparison.__dict__
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eval.json").write_text(json.dumps(report, indent=2))
    print(f"report: {args.out / 'eval.json'}")
    return 0
