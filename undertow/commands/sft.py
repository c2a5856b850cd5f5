"""`undertow sft-collect` and `undertow sft`: the warm start from trajectories.

`sft-collect` records oracle trajectories of tasks through the real mini-swe-agent and
gateway into a tree store (`undertow/sft_collect.py`); `sft` trains on a store's (or an
`undertow export sft` folder's) trajectories with cross-entropy (`learner/sft.py`,
docs/training.md).
"""

import argparse
from pathlib import Path

from undertow.commands import Commands, docker_url_from_env


def add(commands: Commands) -> None:
    sft = commands.add_parser("sft", help="warm start: cross-entropy on stored trajectories")
    source = sft.add_mutually_exclusive_group(required=True)
    source.add_argument("--store", type=Path, help="tree store of the trajectories")
    source.add_argument("--data", type=Path,
                        help="a folder written by `undertow export sft` (sft.jsonl or hf/)")
    sft.add_argument("--model", type=Path, required=True, help="model directory to start from")
    sft.add_argument("--out", type=Path, required=True, help="model directory to write")
    sft.add_argument("-c", "--config", type=Path, default=None, help="config with an sft section")
    sft.add_argument("overrides", nargs="*", metavar="sft.KEY=VALUE")
    sft.set_defaults(handler=_sft)
    _add_collect(commands)


def _add_collect(commands: Commands) -> None:
    collect = commands.add_parser(
        "sft-collect", help="oracle trajectories of tasks (gold patches) through the real "
        "mini-swe-agent and gateway, into a tree store for `undertow sft`")
    collect.add_argument("--tasks", type=Path, required=True,
                         help="tasks.jsonl, a folder holding one, or a local dataset")
    collect.add_argument("--out", type=Path, required=True, help="tree store to write")
    collect.add_argument("--model", type=Path, required=True,
                         help="model directory whose tokenizer the trajectories use")
    collect.add_argument("--logs", type=Path, default=Path("runs/sft-collect"),
                         help="scripts file and session folders")
    collect.add_argument("--num-tasks", type=int, default=None, help="only the first N tasks")
    collect.add_argument("--task", action="append", default=[], help="only this instance_id")
    collect.add_argument("--concurrency", type=int, default=2)
    collect.add_argument("--timeout-s", type=float, default=300.0)
    collect.add_argument("--progress-interval-s", type=float, default=5.0)
    collect.add_argument("--commands", type=Path, default=None, help="JSONL of {instance_id, "
                         "commands}: the oracle runs these as text actions, not the patch")
    collect.add_argument("--agent-config", type=Path, default=None,
                         help="mini-swe-agent config merged last (text-based prompts)")
    collect.add_argument("--step-limit", type=int, default=4)
    collect.add_argument("--max-tokens", type=int, default=None)
    collect.set_defaults(handler=_collect)


def _sft(args: argparse.Namespace) -> int:
    from undertow.config import build_section, read_config
    from undertow.learner.config import SFTConfig
    from undertow.learner.sft import run_sft
    from undertow.learner.trees import load_store_trees

    config = build_section(SFTConfig, read_config(args.config, args.overrides).get("sft"), "sft")
    if args.data is not None:
        from undertow.exports import read_sft_trees

        trees = read_sft_trees(args.data)
    else:
        trees = load_store_trees(args.store)
    print(run_sft(trees, args.model, args.out, config))
    return 0


def _collect(args: argparse.Namespace) -> int:
    from undertow.sft_collect import CollectCommand, main

    return main(CollectCommand(
        tasks=args.tasks, out=args.out, model_dir=args.model, logs_dir=args.logs,
        num_tasks=args.num_tasks, instance_ids=tuple(args.task), concurrency=args.concurrency,
        timeout_s=args.timeout_s, docker_url=docker_url_from_env(),
        progress_interval_s=args.progress_interval_s, commands=args.commands,
        agent_config=args.agent_config, step_limit=args.step_limit,
        max_tokens=args.max_tokens))
