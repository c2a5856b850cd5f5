"""`undertow chat-eval --model DIR`: the pass rate of a model on a prompt task set.

What `undertow train` prints at the end of a chat run to check its checkpoint: the
built-in engine and the embedded gateway (`undertow/run/embedded.py`) run `--samples`
one-call chat sessions per task (`adapters/chat_rollout.py`); it prints each task's pass
rate with Wilson's interval (`undertow/evaluation.py`). `undertow eval` is its
counterpart for scaffolds on SWE tasks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from undertow.commands import Commands

if TYPE_CHECKING:
    from undertow.adapters.chat_rollout import PromptTask


def add(commands: Commands) -> None:
    evaluate = commands.add_parser(
        "chat-eval", help="pass rate of a model on a prompt task set (chat sessions)")
    evaluate.add_argument("--model", type=Path, required=True, help="model directory")
    evaluate.add_argument("--tasks", type=Path, default=None,
                          help="prompt task set (default: the one `undertow train` learns)")
    evaluate.add_argument("--samples", type=int, default=64, help="sessions per task")
    evaluate.add_argument("--concurrency", type=int, default=16)
    evaluate.add_argument("--max-tokens", type=int, default=8)
    evaluate.add_argument("--work-dir", type=Path, default=Path("runs/evaluate"),
                          help="where the gateway's store and the engine log go")
    evaluate.add_argument("--out", type=Path, default=None, help="JSON file to write")
    evaluate.set_defaults(handler=_evaluate)


def _evaluate(args: argparse.Namespace) -> int:
    import asyncio
    import uuid

    from undertow.evaluation import wilson_interval
    from undertow.run.rollout_source import select_prompt_tasks
    from undertow.run.sections import RolloutSection

    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    tasks = select_prompt_tasks(RolloutSection(tasks=args.tasks, scaffold="chat"))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    store_dir = args.work_dir / f"store-{uuid.uuid4().hex[:8]}"
    rows = asyncio.run(_run(args, tasks, store_dir))
    total = [sum(r["num_passed"] for r in rows), sum(r["num_sessions"] for r in rows)]
    rows.append({"instance_id": "all", "num_passed": total[0], "num_sessions": total[1]})
    for row in rows:
        row["pass_rate"] = row["num_passed"] / row["num_sessions"] if row["num_sessions"] else 0
        row["interval_95"] = wilson_interval(row["num_passed"], row["num_sessions"])
        low, high = row["interval_95"]
        print(f"{row['instance_id']}: pass {row['pass_rate']:.1%} ({row['num_passed']}/"
              f"{row['num_sessions']}), 95% interval [{low:.1%}, {high:.1%}]")
    if args.out is not None:
        args.out.write_text(json.dumps({"model": str(args.model), "tasks": rows}, indent=2))
    return 0


async def _run(args: argparse.Namespace, tasks: list[PromptTask],
               store_dir: Path) -> list[dict[str, Any]]:
    from undertow.adapters.chat_rollout import ChatRollout, ChatRolloutConfig
    from undertow.adapters.gateway_client import GatewayAdmin
    from undertow.run.embedded import embedded_gateway

    config = ChatRolloutConfig(group_size=args.samples, concurrency=args.concurrency,
                               max_tokens=args.max_tokens)
    rows = []
    async with embedded_gateway(args.model, store_dir) as gateway, \
            GatewayAdmin(gateway.url, gateway.admin_token) as admin:
        for task in tasks:
            results = await ChatRollout(admin, config).run_group(task, f"eval.{task.instance_id}")
            outcomes = [r for r in results if not r.infra_failure]
            rows.append({"instance_id": task.instance_id, "num_sessions": len(outcomes),
                         "num_passed": sum(r.resolved for r in outcomes),
                         "num_infra_failures": len(results) - len(outcomes)})
    return rows
