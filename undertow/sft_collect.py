"""`undertow sft-collect`: oracle trajectories of tasks, through the real scaffold, into
a tree store that `undertow sft` trains on.

Flow: for each task, its oracle turns (apply the gold patch with `git apply` and a
heredoc, then submit the way mini-swe-agent 2.4 expects) are written in the built-in
model's `<tool_call>` format and tokenized with the model's tokenizer into a scripts
file (`LOGS/scripts.jsonl`). A replay engine (`gateway/engines/scripted.py`) serves
them: each session gets the turns of the task whose problem statement its prompt
holds. The gateway, in front of that engine, writes its tree store to `--out`; the
real mini-swe-agent runs each task once in a Docker sandbox and the rollout grades the
result. So the store holds, as sampled tokens, exactly the oracle's token IDs in the
contexts the scaffold really built, and each session's reward is its grade (1 when the
patch resolves the task).

Two turns, no exploration: the fewest tokens a tiny model has to reproduce, and the
observation between them (`git apply`'s empty output) is the same in every run.

With `commands` (a JSONL file of `{"instance_id", "commands": [...]}`, e.g. the gold
sessions `benchmarks/explore_tasks.py` writes), each task's turns are instead those
shell commands as text actions, one ```bash block a reply (the shape of a text-based
mini-swe-agent config, given as `agent_config`): a multi-turn session whose every
command's real output is in the context of the next reply.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

PATCH_DELIMITER = "UNDERTOW_PATCH"
SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"


@dataclass(frozen=True)
class CollectCommand:
    """Everything `undertow sft-collect` was given. `logs_dir` receives the scripts
    file and the rollout's session folders; `step_limit` bounds mini-swe-agent's calls."""

    tasks: Path
    out: Path
    model_dir: Path
    logs_dir: Path = Path("runs/sft-collect")
    num_tasks: int | None = None
    instance_ids: tuple[str, ...] = ()
    concurrency: int = 2
    timeout_s: float = 300.0
    step_limit: int = 4
    docker_url: str | None = None
    progress_interval_s: float = 5.0
    commands: Path | None = None
    agent_config: Path | None = None
    max_tokens: int | None = None


def _tool_call(thought: str, command: str) -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"THOUGHT: {thought}\n\n<tool_call>\n{call}\n</tool_call>"


def oracle_turns(task) -> list[str]:
    """The assistant turns of a trajectory that solves `task` with its gold patch."""
    patch = task.patch if task.patch.endswith("\n") else task.patch + "\n"
    return [_tool_call("I will apply the fix to the code.",
                       f"git apply <<'{PATCH_DELIMITER}'\n{patch}{PATCH_DELIMITER}"),
            _tool_call("The fix is in place; submitting.", SUBMIT_COMMAND)]


def text_turns(commands: list[str]) -> list[str]:
    """Assistant turns that run `commands` in order, one ```bash block each."""
    return [f"```bash\n{command}\n```" for command in commands]


def read_commands(path: Path) -> dict[str, list[str]]:
    """instance_id -> its oracle's shell commands, from a JSONL file."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return {record["instance_id"]: list(record["commands"]) for record in records}


def oracle_scripts(tasks, model_dir: Path, commands: dict[str, list[str]] | None = None
                   ) -> list:
    """One `ReplayScript` per task: its oracle turns (`text_turns` of its `commands`
    when given, else `oracle_turns`) as token IDs, each ending with the model's first
    stop token, keyed by the task's problem statement."""
    from undertow.gateway.engines.scripted import ReplayScript
    from undertow.gateway.render import Renderer

    missing = [task.instance_id for task in tasks
               if commands is not None and task.instance_id not in commands]
    if missing:
        raise ValueError(f"no oracle commands for {missing[:3]} ({len(missing)} tasks); "
                         "give a commands file written for these tasks, or leave it out")
    renderer = Renderer(model_dir)
    stop_id = min(renderer.stop_token_ids)
    return [ReplayScript(task.problem_statement, tuple(
        tuple(renderer.encode(turn) + [stop_id]) for turn in (
            oracle_turns(task) if commands is None else text_turns(commands[task.instance_id]))))
            for task in tasks]


async def collect(command: CollectCommand, tasks: list):
    """Runs the oracle of each task once; returns the rollout's `RolloutSummary`."""
    from undertow.adapters.gateway_client import GatewayAdmin
    from undertow.adapters.mini_swe_agent import MiniSweAgent
    from undertow.adapters.rollout import Rollout, RolloutConfig, new_run_id
    from undertow.gateway.engines.scripted import ReplayEngine, serve_engine, write_scripts
    from undertow.run.embedded import serve_gateway
    from undertow.sandboxes.connection import connect

    command.logs_dir.mkdir(parents=True, exist_ok=True)
    commands = read_commands(command.commands) if command.commands else None
    scripts_path = write_scripts(command.logs_dir / "scripts.jsonl",
                                 oracle_scripts(tasks, command.model_dir, commands))
    engine = ReplayEngine.from_file(scripts_path, command.model_dir)
    config = RolloutConfig(group_size=1, concurrency=command.concurrency,
                           timeout_s=command.timeout_s, out_dir=command.logs_dir,
                           run_id=f"oracle-{new_run_id().removeprefix('rollout-')}",
                           progress_interval_s=command.progress_interval_s)
    async with (serve_engine(engine) as engine_url,
                serve_gateway(command.model_dir, command.out, [engine_url]) as gateway,
                GatewayAdmin(gateway.url, gateway.admin_token) as admin):
        with connect(command.docker_url) as connection:
            scaffold = MiniSweAgent(
                step_limit=command.step_limit, max_tokens=command.max_tokens,
                overrides=(str(command.agent_config.resolve()),) if command.agent_config else ())
            return await Rollout(tasks, scaffold, admin, connection, config).run()


def main(command: CollectCommand) -> int:
    """Collects, prints the summary table; exit status 1 when no session was resolved."""
    from undertow.run.rollout import RolloutCommand, select_tasks

    tasks = select_tasks(RolloutCommand(tasks=command.tasks, scaffold="mini-swe-agent",
                                        instance_ids=command.instance_ids,
                                        num_tasks=command.num_tasks))
    summary = asyncio.run(collect(command, tasks))
    print(summary.table())
    num_resolved = sum(result.resolved for result in summary.sessions)
    print(f"oracle trajectories: {num_resolved}/{len(summary.sessions)} resolved; "
          f"tree store: {command.out}")
    return 0 if num_resolved else 1
