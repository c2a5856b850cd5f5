"""The tree's worth on a run's own stored trees (issue 37): per group, unique vs flat
tokens, and the learner's tree step vs its per-session step, as a function of the number
of calls per session.

    python -m benchmarks.tree_worth STORE [STORE ...] --model MODEL
        [--methods tree,per_session] [--max-groups N] [--compare-grads]
        [--out benchmarks/results/tree_worth.json]

STORE is a tree store as the gateway writes it (`runs/RUN/train/store`, one `GROUP.jsonl`
a group), read back with the learner's own loader (`learner/trees.py`). Per group:

- num_unique_tokens: the tokens the tree holds (`Tree.num_unique_tokens`): what tree
  packing runs;
- num_flat_tokens: every call's prompt plus completion (`Tree.num_flat_tokens`): what a
  per-call log holds and one sample per call runs;
- num_session_tokens: what one sample per session holds: every path (root to leaf) of
  every session, whole. A session whose history was never rewritten has one path, its last
  call's prompt plus completion; `num_session_paths` counts the paths;
- calls per session (mean, min, max) over the sessions that made a call.

Timing: up to `--max-groups` groups, spread evenly over the range of mean calls per session
(the fewest and the most included), each method's step in a fresh subprocess by
`benchmarks/learner.py`'s worker (`--tree-json`, one torch thread, the model in float32):
step_s, step_cpu_s (the process's CPU time, robust to other load), peak_step_mib, loss,
and each method's ratios to the tree step; with `--compare-grads`, also how far its
gradient is from the tree step's (max over parameters of max |difference| / max |gradient|).
A group whose rewards are all equal (every advantage 0: the loss and the gradient are 0
whatever the method) is timed with stand-in rewards, 1 for every second session and 0 for
the others (`"rewards": "stand-in"` in its row); the step's work does not depend on the
rewards. With advantages summing to 0, the loss is near 0 when every session trains as many
tokens and the ratios are near 1 (on-policy samples): then the gradient is the check.

Groups are listed by mean calls per session and summed by bucket of it: a group whose mean,
rounded to a whole number, is 2k-1 or 2k is in bucket "2k-1-2k". Writes `--out` (JSON:
every figure, the command, the model, the load average) and the Markdown tables beside it
(`.md`), and prints them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.learner import REPO, resolve_model
from undertow.gateway.trees.tree import Tree, tree_to_json
from undertow.learner.advantages import is_uniform, session_rewards
from undertow.learner.config import AdvantageConfig
from undertow.learner.trees import load_store_trees

RESULTS = Path(__file__).resolve().parent / "results" / "tree_worth.json"
METHODS = ("tree", "per_session", "per_call")
BUCKET_WIDTH = 2


def load_groups(stores: list[Path]) -> list[Tree]:
    """Every group tree of the stores, in store then group order; SystemExit naming a
    store that is not there or holds no group tree."""
    trees = []
    for store in stores:
        if not store.is_dir():
            raise SystemExit(f"no tree store at {store}: give a store directory as the "
                             "gateway writes it (runs/RUN/train/store)")
        found = load_store_trees(store)
        if not found:
            raise SystemExit(f"{store} holds no group tree (no readable GROUP.jsonl): give "
                             "the store of a run that recorded calls (runs/RUN/train/store)")
        trees += found
    return trees


def check_vocabulary(trees: list[Tree], model_dir: Path) -> None:
    """SystemExit when a stored token ID is past the model's vocabulary: the trees were
    sampled through another tokenizer, and their step on this model means nothing."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    largest = max((max(node.token_ids, default=0) for tree in trees
                   for node in tree.nodes.values()), default=0)
    if largest >= vocab_size:
        raise SystemExit(f"the store holds token ID {largest}, past {model_dir.name}'s "
                         f"vocabulary of {vocab_size}: its calls were tokenized for another "
                         "model; give the model the run sampled with")


def session_contents(tree: Tree) -> dict[str, tuple]:
    """Each session's token IDs (its paths'), by session: equal for sessions that sampled
    the same tokens from the same prompts."""
    return {session_id: tuple(tuple(tree.path_token_ids(leaf)) for leaf in paths.leaves)
            for session_id, paths in tree.sessions.items()}


def group_counts(tree: Tree) -> dict:
    """The group's sizes (module docstring)."""
    calls = Counter(call.session_id for call in tree.calls)
    paths = [leaf for session_id in calls for leaf in tree.sessions[session_id].leaves]
    contents = session_contents(tree)
    num_session_tokens = sum(tree.path_length(leaf) for leaf in paths)
    unique, flat = tree.num_unique_tokens, tree.num_flat_tokens
    return {"group": tree.group_id, "num_sessions": len(calls), "num_calls": len(tree.calls),
            "num_distinct_sessions": len({contents[session_id] for session_id in calls}),
            "calls_per_session": {"mean": len(tree.calls) / len(calls) if calls else 0.0,
                                  "min": min(calls.values(), default=0),
                                  "max": max(calls.values(), default=0)},
            "num_unique_tokens": unique, "num_flat_tokens": flat,
            "flat_over_unique": flat / unique if unique else None,
            "num_session_paths": len(paths), "num_session_tokens": num_session_tokens,
            "session_over_unique": num_session_tokens / unique if unique else None}


def stand_in_rewards(tree: Tree) -> bool:
    """Closes the group's sessions again with stand-in rewards when the rewards its
    advantages see (the worker's `AdvantageConfig()`) are all equal (module docstring);
    whether it did. Sessions of the same tokens share one:
    0 for the first distinct content, 1 for the second, and so on alternately, so that
    their terms do not cancel (in a group of one content repeated, they alternate by
    session; its gradient is 0 whatever the rewards)."""
    rewards = session_rewards(tree, AdvantageConfig())
    if len(rewards) < 2 or not is_uniform(rewards):
        return False
    contents = session_contents(tree)
    order = list(dict.fromkeys(contents[session_id] for session_id in rewards))
    for index, session_id in enumerate(rewards):
        rank = order.index(contents[session_id]) if len(order) > 1 else index
        tree.close_session(session_id, float(rank % 2), tree.sessions[session_id].meta)
    return True


def time_method(method: str, tree_json: Path, model_dir: Path, timeout_s: int,
                grads_out: Path | None = None) -> dict:
    """One method's step on the tree in `tree_json`, in a fresh `benchmarks.learner`
    worker process (which writes the step's gradients to `grads_out`, if given)."""
    command = [sys.executable, "-m", "benchmarks.learner", "--worker", method,
               "--tree-json", str(tree_json), "--model-dir", str(model_dir),
               "--per-call-every", "1", *(["--grads-out", str(grads_out)] if grads_out else [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"{method} on {tree_json.name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def grad_errors(expected: Path, got: Path) -> dict[str, float]:
    """How far the gradient in `got` is from `expected`: "grad_rel_error", the max over
    parameters of max |difference| / max |expected| (the learner benchmark's FSDP2
    figure: a parameter whose gradient is all cancellation weighs as much as any), and
    "grad_rel_norm_error", |difference| / |expected| over all parameters as one vector.
    Read one parameter at a time (a 0.5B model's gradients are 2.5 GB a file)."""
    from safetensors import safe_open

    error, diff_sq, norm_sq = 0.0, 0.0, 0.0
    with safe_open(str(expected), "pt") as want, safe_open(str(got), "pt") as have:
        names = want.keys()
        for name in names:
            reference = want.get_tensor(name).double()
            difference = have.get_tensor(name).double() - reference
            error = max(error, float(difference.abs().max())
                        / (float(reference.abs().max()) or 1.0))
            diff_sq += float(difference.square().sum())
            norm_sq += float(reference.square().sum())
    return {"grad_rel_error": error,
            "grad_rel_norm_error": math.sqrt(diff_sq / norm_sq) if norm_sq else math.inf}


def time_group(tree: Tree, methods: tuple[str, ...], model_dir: Path, timeout_s: int,
               scratch: Path, compare_grads: bool = False) -> dict:
    """The group's timing fields: each method's worker row and its ratios to the tree's
    (with `compare_grads`, how far its gradient is from the tree step's too, unless
    every session holds the same tokens: then the gradient is 0 and its difference is
    rounding)."""
    rewards = "stand-in" if stand_in_rewards(tree) else "stored"
    tree_json = scratch / f"{tree.group_id}.json"
    tree_json.write_text(json.dumps(tree_to_json(tree)))
    compare_grads = compare_grads and len(set(session_contents(tree).values())) > 1
    grads = {m: scratch / f"{m}.safetensors" if compare_grads else None for m in methods}
    timing = {method: time_method(method, tree_json, model_dir, timeout_s, grads[method])
              for method in methods}
    fields: dict = {"rewards": rewards, "timing": timing}
    if "tree" in timing:
        for method in methods:
            if method != "tree":
                fields[f"{method}_over_tree"] = {
                    key: timing[method][key] / timing["tree"][key]
                    for key in ("step_s", "step_cpu_s")}
                if compare_grads:
                    fields[f"{method}_over_tree"].update(grad_errors(grads["tree"],
                                                                     grads[method]))
    for path in grads.values():
        if path is not None:
            path.unlink(missing_ok=True)
    return fields


def spread(num_items: int, num_picked: int) -> list[int]:
    """`num_picked` indices of `num_items`, evenly spaced, both ends included."""
    if num_picked >= num_items:
        return list(range(num_items))
    if num_picked == 1:
        return [num_items - 1]
    return sorted({round(i * (num_items - 1) / (num_picked - 1)) for i in range(num_picked)})


def bucket_of(mean_calls: float) -> str:
    """The bucket of a group's mean calls per session, rounded to a whole number."""
    top = max(1, math.ceil(math.floor(mean_calls + 0.5) / BUCKET_WIDTH)) * BUCKET_WIDTH
    return f"{top - BUCKET_WIDTH + 1}-{top}"


def summarize(rows: list[dict], methods: tuple[str, ...]) -> list[dict]:
    """Per bucket of mean calls per session: sums of the groups' counts, their ratios, and
    each method's step CPU over the tree's, summed over the bucket's timed groups."""
    buckets: dict[str, list[dict]] = {}
    for row in rows:
        buckets.setdefault(bucket_of(row["calls_per_session"]["mean"]), []).append(row)
    summary = []
    for bucket, members in buckets.items():
        unique = sum(r["num_unique_tokens"] for r in members)
        entry = {"calls_per_session": bucket, "num_groups": len(members),
                 "num_sessions": sum(r["num_sessions"] for r in members),
                 "num_calls": sum(r["num_calls"] for r in members),
                 "num_unique_tokens": unique,
                 "num_flat_tokens": sum(r["num_flat_tokens"] for r in members),
                 "num_session_tokens": sum(r["num_session_tokens"] for r in members)}
        entry["flat_over_unique"] = entry["num_flat_tokens"] / unique if unique else None
        entry["session_over_unique"] = entry["num_session_tokens"] / unique if unique else None
        timed = [r["timing"] for r in members if "timing" in r and "tree" in r["timing"]]
        entry["num_timed_groups"] = len(timed)
        for method in methods:
            if method != "tree" and timed:
                entry[f"{method}_over_tree_cpu"] = (
                    sum(t[method]["step_cpu_s"] for t in timed)
                    / sum(t["tree"]["step_cpu_s"] for t in timed))
        summary.append(entry)
    return summary


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def counts_table(rows: list[dict]) -> str:
    lines = ["| group | sessions (distinct) | calls / session (min-max) | unique tokens "
             "| flat tokens | flat / unique | per-session tokens | per-session / unique |",
             "|---" + "|---:" * 7 + "|"]
    for r in rows:
        calls = r["calls_per_session"]
        lines.append(f"| {r['group']} | {r['num_sessions']} ({r['num_distinct_sessions']}) "
                     f"| {calls['mean']:.1f} ({calls['min']}-{calls['max']}) "
                     f"| {r['num_unique_tokens']:,} | {r['num_flat_tokens']:,} "
                     f"| {_ratio(r['flat_over_unique'])} | {r['num_session_tokens']:,} "
                     f"| {_ratio(r['session_over_unique'])} |")
    return "\n".join(lines)


def timing_table(rows: list[dict]) -> str:
    lines = ["| group | calls / session | rewards | method | tokens run | step s (wall) "
             "| step s (CPU) | vs tree (CPU) | vs tree (wall) | peak step MiB | loss "
             "| gradient vs tree (worst parameter, all) |",
             "|---|---:|---|---" + "|---:" * 8 + "|"]
    for r in (r for r in rows if "timing" in r):
        for method, t in r["timing"].items():
            ratios = r.get(f"{method}_over_tree", {})
            lines.append(
                f"| {r['group']} | {r['calls_per_session']['mean']:.1f} | {r['rewards']} "
                f"| {method} | {t['num_tokens']:,} | {t['step_s']:.1f} | {t['step_cpu_s']:.1f} "
                f"| {_ratio(ratios.get('step_cpu_s', 1.0 if method == 'tree' else None))} "
                f"| {_ratio(ratios.get('step_s', 1.0 if method == 'tree' else None))} "
                f"| {t['peak_step_mib']:,.0f} | {t['loss']:.6f} "
                f"| {'reference' if method == 'tree' else _errors(r, ratios)} |")
    return "\n".join(lines)


def _errors(row: dict, ratios: dict) -> str:
    if "grad_rel_error" in ratios:
        return f"{ratios['grad_rel_error']:.1e}, {ratios['grad_rel_norm_error']:.1e}"
    return "n/a (sessions identical)" if row["num_distinct_sessions"] < 2 else "n/a"


def buckets_table(summary: list[dict], methods: tuple[str, ...]) -> str:
    others = [m for m in methods if m != "tree"]
    lines = ["| calls / session | groups | sessions | calls | unique tokens | flat tokens "
             "| flat / unique | per-session / unique | timed groups "
             + "".join(f"| {m} / tree (CPU) " for m in others) + "|",
             "|---" + "|---:" * (8 + len(others)) + "|"]
    for e in summary:
        cells = [e["calls_per_session"], str(e["num_groups"]), str(e["num_sessions"]),
                 str(e["num_calls"]), f"{e['num_unique_tokens']:,}",
                 f"{e['num_flat_tokens']:,}", _ratio(e["flat_over_unique"]),
                 _ratio(e["session_over_unique"]), str(e["num_timed_groups"])]
        cells += [_ratio(e.get(f"{m}_over_tree_cpu")) for m in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(rows: list[dict], summary: list[dict], methods: tuple[str, ...]) -> str:
    """The groups' counts by mean calls per session, the timed groups' steps, and the
    buckets."""
    return "\n\n".join([counts_table(rows), timing_table(rows),
                         buckets_table(summary, methods)])


def write_results(out: Path, header: dict, rows: list[dict], methods: tuple[str, ...]
                  ) -> str:
    """Writes the JSON and the `.md` beside it; returns the Markdown."""
    summary = summarize(rows, methods)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**header, "load_average_after": os.getloadavg(),
                               "groups": rows, "buckets": summary}, indent=2) + "\n")
    table = markdown(rows, summary, methods)
    out.with_suffix(".md").write_text(table + "\n")
    return table


def measure(trees: list[Tree], model_dir: Path, methods: tuple[str, ...],
            max_groups: int | None, timeout_s: int, out: Path, header: dict,
            compare_grads: bool = False) -> str:
    """Counts every group, times the picked ones, writing the results after each."""
    counted = sorted(((group_counts(tree), tree) for tree in trees), key=lambda pair: (
        pair[0]["calls_per_session"]["mean"], pair[0]["group"]))
    rows, trees = [row for row, _ in counted], [tree for _, tree in counted]
    picked = spread(len(trees), len(trees) if max_groups is None else max_groups)
    table = write_results(out, header, rows, methods)
    with tempfile.TemporaryDirectory(prefix="undertow-tree-worth-") as scratch:
        for index in picked:
            rows[index].update(time_group(trees[index], methods, model_dir, timeout_s,
                                          Path(scratch), compare_grads))
            print(json.dumps(rows[index]), flush=True)
            table = write_results(out, header, rows, methods)
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stores", nargs="+", type=Path, metavar="STORE")
    parser.add_argument("--model", required=True,
                        help="the model the run sampled with: a directory or a name of "
                        "benchmarks.learner.MODELS")
    parser.add_argument("--methods", default="tree,per_session")
    parser.add_argument("--max-groups", type=int, default=None,
                        help="time at most this many groups (default: every group)")
    parser.add_argument("--timeout-s", type=int, default=3600)
    parser.add_argument("--compare-grads", action="store_true",
                        help="also compare each method's gradient with the tree step's "
                        "(written to a scratch folder: 4 bytes a parameter a method)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    methods = tuple(args.methods.split(","))
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    model_dir = resolve_model(args.model)
    trees = load_groups(args.stores)
    check_vocabulary(trees, model_dir)
    header = {"command": " ".join(["python -m benchmarks.tree_worth",
                                    *(sys.argv[1:] if argv is None else argv)]),
              "model": str(model_dir), "stores": [str(s) for s in args.stores],
              "methods": list(methods), "cpu_count": os.cpu_count(),
              "load_average_before": os.getloadavg(), "started": time.strftime("%FT%T%z")}
    print(measure(trees, model_dir, methods, args.max_groups, args.timeout_s, args.out, header,
                  args.compare_grads))


if __name__ == "__main__":
    main()
