"""`undertow chat-eval --model DIR`: the pass rate of a model on a prompt task set.

What `undertow train` prints at the end of a chat run (`rollout.scaffold: chat`) to
check its checkpoint: the built-in engine on the model, the embedded gateway, and
`--samples` one-call chat sessions per task at temperature 1 (`adapters/chat_rollout.py`,
rewarded by each task's function). Prints one line per task and the total, with a 95%
Wilson interval of the pass rate; `--out` also writes them as JSON. (`undertow eval`
does the same for scaffolds on SWE tasks in sandboxes.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def add(commands) -> None:
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


def wilson_interval(num_passed: int, num_sessions: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial pass rate."""
    if num_sessions == 0:
        return 0.0, 1.0
    rate = num_passed / num_sessions
    denominator = 1 + z * z / num_sessions
    centre = (rate + z * z / (2 * num_sessions)) / denominator
    spread = z * math.sqrt(rate * (1 - rate) / num_sessions
                           + z * z / (4 * num_sessions ** 2)) / denominator
    return max(0.0, centre - spread), min(1.0, centre + spread)


def _evaluate(args) -> int:
    import asyncio
    import uuid

    from undertow.rollout_source import RolloutSection, select_prompt_tasks

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


async def _run(args, tasks, store_dir: Path) -> list[dict]:
    from undertow.adapters.chat_rollout import ChatRollout, ChatRolloutConfig
    from undertow.adapters.gateway_client import GatewayAdmin
    from undertow.embedded import embedded_gateway

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
