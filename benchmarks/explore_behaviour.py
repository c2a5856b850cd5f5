"""What the agent did in a rollout of the exploration tasks, read from its tree store.

    python -m benchmarks.explore_behaviour TASKS_DIR ROLLOUT_OUT MODEL_DIR

`benchmarks/learning.py --family explore` calls `behaviour` after each held-out
rollout (`undertow rollout --out ROLLOUT_OUT`); this command prints the same figures for
one rollout. Each call's completion is read from the tree store (`<run>/gateway/store`,
the token IDs the engine sampled), decoded with the policy's tokenizer, and its command
(the reply's ```bash block, as configs/explore_mini_swe_agent.yaml's `action_regex`)
classified by `command_kind`. Per rollout:

- calls per session: the distribution over all sessions, and the mean over resolved ones;
- how often the agent searches (grep, find, ls) before its first edit, over sessions
  with an edit; how often its first edit names the fix's file (its path's last part);
- entropy: the mean of -logprob over the sampled completion tokens (at temperature 1 an
  unbiased estimate of the policy's per-token entropy on its own samples);
- the command kinds of every call, counted;
- how many sessions send the command they sent last again (a loop: the same `cat` until
  the step limit, as the small models do; a reply with no command is passed over).
"""

from __future__ import annotations

import argparse
import json
import re
from itertools import pairwise
from pathlib import Path

from undertow.adapters.summary import ended_sessions

ACTION = re.compile(r"```(?:bash|sh|mswea_bash_command)?[ \t]*\n(.*?)\n```", re.S)
EDIT = re.compile(r"\bsed\s+(-\w*\s+)*-i|\bperl\s+-\w*i|>\s*\S+\.py|\btee\b|"
                  r"\bpython3?\s+-c\b.*\b(write|open)\b")
SEARCH = re.compile(r"^\s*(grep|egrep|rg|find|ls|tree|git\s+grep)\b")
READ = re.compile(r"^\s*(cat|sed\s+-n|head|tail|nl|less|more|awk)\b")
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def command_kind(command: str | None) -> str:
    """"edit", "search", "read", "submit", "run" (anything else) or "none" (no
    command in the reply). An edit anywhere in a compound command makes it an edit."""
    if command is None:
        return "none"
    if SUBMIT in command:
        return "submit"
    if EDIT.search(command):
        return "edit"
    if SEARCH.match(command):
        return "search"
    if READ.match(command):
        return "read"
    return "run"


def fix_files(tasks_dir: Path) -> dict[str, str]:
    """Per instance, the file its gold patch changes."""
    files = {}
    for line in (tasks_dir / "tasks.jsonl").read_text().splitlines():
        task = json.loads(line)
        changed = re.findall(r"^\+\+\+ b/(.+)$", task["patch"], re.M)
        if len(changed) != 1:
            raise ValueError(f"{task['instance_id']}: its patch changes {len(changed)} files; "
                             "explore_tasks.py writes one: regenerate the tasks")
        files[task["instance_id"]] = changed[0]
    return files


def session_commands(store: Path, decode) -> dict[str, list[tuple[str | None, list[float]]]]:
    """Per session, each call's command (None: none in the reply) and its completion
    tokens' logprobs, in call order."""
    from undertow.learner.trees import load_store_trees

    sessions: dict[str, list[tuple[str | None, list[float]]]] = {}
    for tree in load_store_trees(store):
        for call in tree.calls:
            token_ids, logprobs = [], []
            for node_id in tree.path(call.leaf):
                node = tree.nodes[node_id]
                token_ids += node.token_ids
                logprobs += node.logprobs if node.logprobs else [0.0] * len(node.token_ids)
            num = call.num_completion_tokens
            found = ACTION.search(decode(token_ids[len(token_ids) - num:]))
            sessions.setdefault(call.session_id, []).append(
                (found[1] if found else None, logprobs[len(logprobs) - num:]))
    return sessions


def behaviour_of(sessions: dict, summary: dict, files: dict[str, str]) -> dict:
    """The figures of the module docstring, from `session_commands` and the rollout's
    summary.json."""
    calls: dict[int, int] = {}
    kinds: dict[str, int] = {}
    resolved_calls, searched_first, right_file_first, num_edited = [], 0, 0, 0
    num_repeating = 0
    logprobs: list[float] = []
    for record in summary["sessions"]:
        commands = sessions.get(record["session_id"], [])
        calls[len(commands)] = calls.get(len(commands), 0) + 1
        if record.get("resolved"):
            resolved_calls.append(len(commands))
        order = [command_kind(command) for command, _ in commands]
        for kind in order:
            kinds[kind] = kinds.get(kind, 0) + 1
        for _, sampled in commands:
            logprobs += sampled
        sent = [command for command, _ in commands if command is not None]
        num_repeating += any(a == b for a, b in pairwise(sent))
        if "edit" in order:
            num_edited += 1
            first = order.index("edit")
            searched_first += "search" in order[:first]
            name = files[record["instance_id"]].rsplit("/", 1)[-1]
            right_file_first += name in (commands[first][0] or "")
    return {"num_sessions": len(summary["sessions"]),
            "calls_per_session": dict(sorted(calls.items())),
            "calls_per_resolved_session_mean": sum(resolved_calls) / len(resolved_calls)
            if resolved_calls else None,
            "num_sessions_with_edit": num_edited,
            "search_before_edit": searched_first / num_edited if num_edited else None,
            "right_file_first_edit": right_file_first / num_edited if num_edited else None,
            "entropy_per_token": -sum(logprobs) / len(logprobs) if logprobs else None,
            "command_kinds": kinds,
            "num_sessions_repeating": num_repeating}


def behaviour(tasks_dir: Path, rollout_out: Path, model_dir: Path) -> dict:
    """The figures of every rollout under `rollout_out` (`undertow rollout --out`), pooled:
    a held-out point may be made of more than one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sessions: dict = {}
    records: list = []
    for summary_path in sorted(rollout_out.glob("*/summary.json")):
        sessions.update(session_commands(summary_path.parent / "gateway" / "store",
                                         tokenizer.decode))
        records += ended_sessions(json.loads(summary_path.read_text())["sessions"])
    return behaviour_of(sessions, {"sessions": records}, fix_files(tasks_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("tasks", type=Path)
    parser.add_argument("rollout_out", type=Path)
    parser.add_argument("model", type=Path)
    args = parser.parse_args()
    print(json.dumps(behaviour(args.tasks, args.rollout_out, args.model), indent=2))


if __name__ == "__main__":
    main()
