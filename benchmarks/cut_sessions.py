"""What valuing cut sessions by the tree is worth (issue 37): arms of the explore benchmark
that differ only in `--cut-sessions`, side by side.

    python -m benchmarks.cut_sessions RESULTS.json RESULTS.json [...]
        [--out benchmarks/results/cut_sessions.json]

Each RESULTS.json is what `python -m benchmarks.learning --family explore --cut-sessions
RULE --train-timeout-s S` wrote; its run's tree store (`WORK/train/store`) is read back
with the learner's own loader. Per arm:

- the held-out point at its last RL step against its step 0 (Newcombe's 95% interval of
  the difference), and the last points of each later arm against the first arm's;
- per RL step, how many sessions the time limit cut (`num_cut_sessions` in metrics.jsonl);
- on the arm's own trees, every rule of `advantages.timeout_reward` applied to the same
  groups (`learner.advantages.session_rewards`): the sessions that enter a group and the
  groups with a reward to compare (not uniform). For `tree_value`, the mean value a cut
  session enters with against its graded reward, and how many cut sessions the tree
  values otherwise than the mean of their group's finished sessions (what a value by
  shared node rather than shared tokens gave them all: gateway/trees/tree_value.py).

The same trees under the three rules say what the rule changes in what is trained; the
held-out points say whether that changed what the policy learned. Cut sessions depend on
load (a wall-clock limit on a shared machine), so two arms cut different sessions even
with the same seed.

Writes `--out` (JSON, every figure) and the Markdown table beside it (`.md`), and prints it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from undertow.evaluation import difference_interval
from undertow.learner.advantages import is_timed_out, is_uniform, session_rewards, valid_sessions
from undertow.learner.config import TIMEOUT_REWARDS, AdvantageConfig
from undertow.learner.trees import load_store_trees

RESULTS = Path(__file__).resolve().parent / "results" / "cut_sessions.json"


def rules_on_trees(store: Path) -> dict:
    """Every timeout rule on the same stored groups: sessions entering, groups with
    variance; the cut sessions' graded rewards and tree values."""
    trees = load_store_trees(store)
    by_rule = {}
    for rule in TIMEOUT_REWARDS:
        config = AdvantageConfig(timeout_reward=rule)
        rewards = [session_rewards(tree, config) for tree in trees]
        by_rule[rule] = {"num_sessions_entering": sum(len(r) for r in rewards),
                         "num_groups_with_variance": sum(not is_uniform(r) for r in rewards)}
    graded, valued, num_off_mean = [], [], 0
    tree_value = AdvantageConfig(timeout_reward="tree_value")
    for tree in trees:
        values = session_rewards(tree, tree_value)
        finished = session_rewards(tree, AdvantageConfig(timeout_reward="drop"))
        finished_mean = sum(finished.values()) / len(finished) if finished else None
        for session_id, reward in valid_sessions(tree).items():
            if is_timed_out(tree, session_id):
                graded.append(reward)
                valued.append(values[session_id])
                num_off_mean += finished_mean is not None and values[session_id] != finished_mean
    return {"num_groups": len(trees),
            "num_sessions": sum(len(valid_sessions(tree)) for tree in trees),
            "num_cut_sessions": len(graded),
            "cut_graded_reward_mean": sum(graded) / len(graded) if graded else None,
            "cut_tree_value_mean": sum(valued) / len(valued) if valued else None,
            "num_cut_valued_off_group_mean": num_off_mean,
            "rules": by_rule}


def point_difference(first: dict, last: dict) -> dict:
    low, high = difference_interval(first["num_resolved"], first["num_sessions"],
                                    last["num_resolved"], last["num_sessions"])
    return {"difference": last["pass_rate"] - first["pass_rate"], "interval": [low, high],
            "excludes_zero": low > 0 or high < 0}


def arm(results_path: Path) -> dict:
    results = json.loads(results_path.read_text())
    evals = [e for e in results["evaluations"] if e["split"] == "heldout"]
    first, last = evals[0], evals[-1]
    args = results["args"]  # as the benchmark wrote them: strings
    limit = args["train_timeout_s"] if args["train_timeout_s"] != "None" else args["timeout_s"]
    store = Path(args["work"]) / "train" / "store"
    return {"results": str(results_path), "cut_sessions": args["cut_sessions"],
            "train_timeout_s": float(limit),
            "cut_per_step": [s.get("num_cut_sessions") for s in results["rl"]["steps"]],
            "first_point": _point(first), "last_point": _point(last),
            "gain": point_difference(first, last), "trees": rules_on_trees(store)}


def _point(evaluation: dict) -> dict:
    return {key: evaluation[key] for key in
            ("rl_step", "num_sessions", "num_resolved", "pass_rate", "interval")}


def compare(arms: list[dict]) -> list[dict]:
    """Each later arm's last held-out point against the first arm's."""
    base = arms[0]
    return [{"arm": other["cut_sessions"], "against": base["cut_sessions"],
             **point_difference(base["last_point"], other["last_point"])}
            for other in arms[1:]]


def table(arms: list[dict], differences: list[dict]) -> str:
    lines = ["| arm | limit | cut per step | held-out, step 0 | held-out, last step | gain "
             "(Newcombe 95%) | sessions entering, own rule | groups with variance: "
             "tree_value / drop / partial_credit | cut sessions: graded reward, tree value "
             "(off the finished mean) |",
             "|---|---:|---|---|---|---|---:|---|---|"]
    for a in arms:
        trees, first, last, gain = a["trees"], a["first_point"], a["last_point"], a["gain"]
        rules = trees["rules"]
        lines.append(
            f"| `{a['cut_sessions']}` | {a['train_timeout_s']:.0f} s | "
            f"{', '.join('-' if n is None else str(n) for n in a['cut_per_step'])} "
            f"({sum(n for n in a['cut_per_step'] if n is not None)}) | "
            f"{_rate(first)} | {_rate(last)} (step {last['rl_step']}) | "
            f"{_signed(gain)} | {rules[a['cut_sessions']]['num_sessions_entering']} of "
            f"{trees['num_sessions']} | "
            + " / ".join(str(rules[r]["num_groups_with_variance"])
                         for r in ("tree_value", "drop", "partial_credit"))
            + f" of {trees['num_groups']} | {_mean(trees['cut_graded_reward_mean'])}, "
            f"{_mean(trees['cut_tree_value_mean'])} ({trees['num_cut_sessions']}; "
            f"{trees['num_cut_valued_off_group_mean']}) |")
    for d in differences:
        lines.append(f"\n`{d['arm']}` against `{d['against']}` at the last point: "
                     f"{_signed(d)}.")
    return "\n".join(lines)


def _rate(point: dict) -> str:
    low, high = point["interval"]
    return (f"{point['num_resolved']}/{point['num_sessions']} {100 * point['pass_rate']:.1f}% "
            f"({100 * low:.1f}-{100 * high:.1f}%)")


def _signed(difference: dict) -> str:
    low, high = difference["interval"]
    return f"{100 * difference['difference']:+.1f} points ({100 * low:+.1f} to {100 * high:+.1f})"


def _mean(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", type=Path,
                        help="benchmarks.learning results of each arm, the reference first")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    arms = [arm(path) for path in args.results]
    differences = compare(arms)
    args.out.write_text(json.dumps({"arms": arms, "differences": differences}, indent=1) + "\n")
    markdown = table(arms, differences)
    args.out.with_suffix(".md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
