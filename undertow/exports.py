"""What a rollout run gives to tools outside Undertow: predictions and fine-tuning data.

`export_predictions` writes SWE-bench's predictions JSONL from the run's `summary.json`;
`sft_records` and `write_sft` a tree store's closed sessions as chat-format records with
their exact token IDs, which `read_sft_trees` turns back into group trees for `undertow
sft`. Both formats, and which session of a group is "best", are in docs/commands.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from undertow.gateway.trees.tree import Tree
from undertow.sandboxes.artefacts import without_new_artefacts

# adapters/rollout.py keeps the last 20,000 characters of a session's diff.
_KEPT_DIFF_CHARS = 20000
# Token IDs -> their text, with the model's tokenizer.
Decode = Callable[[Sequence[int]], str]


def read_summary(run: Path) -> dict[str, Any]:
    """The `summary.json` of a rollout run folder (or the file itself)."""
    path = run / "summary.json" if run.is_dir() else run
    if not path.is_file():
        raise FileNotFoundError(f"no summary.json in {run}; give a rollout run folder "
                                "(RUN_DIR/<run id>) that `undertow rollout` wrote")
    return json.loads(path.read_text(encoding="utf-8"))


def _best(sessions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    best: dict[str, dict[str, Any]] = {}
    for session in sessions:
        kept = best.get(session["instance_id"])
        if kept is None or session["reward"] > kept["reward"]:
            best[session["instance_id"]] = session
    return list(best.values())


def prediction(session: dict[str, Any], model_name: str) -> tuple[dict[str, Any], int]:
    """One session as a SWE-bench prediction, and how many build artefacts its recorded
    diff added that the prediction leaves out."""
    patch, num_artefacts = without_new_artefacts((session.get("details") or {}).get("diff", ""))
    return {"instance_id": session["instance_id"], "model_name_or_path": model_name,
            "model_patch": patch}, num_artefacts


@dataclass(frozen=True)
class PredictionsReport:
    num_sessions: int
    num_written: int
    num_cut: int
    out_path: Path
    num_artefacts: int = 0

    def summary(self) -> str:
        line = (f"wrote {self.num_written} predictions from {self.num_sessions} sessions to "
                f"{self.out_path}")
        if self.num_cut:
            line += (f"; {self.num_cut} diffs were cut to their last {_KEPT_DIFF_CHARS} "
                     "characters by the rollout and will not apply")
        if self.num_artefacts:
            line += (f"; {self.num_artefacts} build artefacts (bytecode, test caches) the "
                     "recorded diffs added were left out")
        return line


def export_predictions(run: Path, out: Path, *, select: str = "best",
                       model_name: str | None = None) -> PredictionsReport:
    """Writes the run's predictions; `select` is "best" (one per instance) or "all"."""
    if select not in ("best", "all"):
        raise ValueError(f"select must be best or all, got {select!r}")
    summary = read_summary(run)
    sessions = [s for s in summary["sessions"] if s.get("session_id")]
    chosen = _best(sessions) if select == "best" else sessions
    name = model_name or f"undertow-{summary.get('scaffold', 'run')}"
    out.parent.mkdir(parents=True, exist_ok=True)
    num_cut = num_artefacts = 0
    with out.open("w", encoding="utf-8") as file:
        for session in chosen:
            record, num_dropped = prediction(session, name)
            num_artefacts += num_dropped
            recorded = (session.get("details") or {}).get("diff", "")
            num_cut += (len(recorded) >= _KEPT_DIFF_CHARS
                        and not recorded.startswith("diff --git"))
            if select == "all":
                record.update(session_id=session["session_id"], reward=session["reward"])
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
    return PredictionsReport(len(sessions), len(chosen), num_cut, out, num_artefacts)


def _spans(trainable: list[bool]) -> list[tuple[int, int, bool]]:
    """(start, end, trainable) runs of equal flags."""
    spans, start = [], 0
    for index in range(1, len(trainable) + 1):
        if index == len(trainable) or trainable[index] != trainable[start]:
            spans.append((start, index, trainable[start]))
            start = index
    return spans


def session_records(tree: Tree, session_id: str,
                    decode: Decode | None = None) -> list[dict[str, Any]]:
    """A closed session's paths as SFT records (see the module docstring)."""
    paths = tree.sessions[session_id]
    records = []
    for index, leaf in enumerate(paths.leaves):
        token_ids, trainable, logprobs, versions = [], [], [], []
        for node_id in tree.path(leaf):
            node = tree.nodes[node_id]
            token_ids += node.token_ids
            trainable += [node.sampled_by == session_id] * len(node.token_ids)
            logprobs += [None if math.isnan(v) else v for v in node.logprobs]
            versions += node.weight_versions
        messages = [{"role": "assistant" if sampled else "user",
                     "content": decode(token_ids[start:end]) if decode else ""}
                    for start, end, sampled in _spans(trainable)]
        records.append({
            "group_id": tree.group_id, "session_id": session_id, "path_index": index,
            "instance_id": paths.meta.get("instance_id", ""), "reward": paths.reward,
            "messages": messages, "token_ids": token_ids, "trainable": trainable,
            "logprobs": logprobs, "weight_versions": versions})
    return records


def sft_records(trees: list[Tree], min_reward: float | None,
                decode: Decode | None = None) -> list[dict[str, Any]]:
    """Every closed session's paths at or above `min_reward`, in group and session order."""
    return [record for tree in trees for session_id, paths in tree.sessions.items()
            if paths.closed and (min_reward is None or (paths.reward is not None
                                                        and paths.reward >= min_reward))
            for record in session_records(tree, session_id, decode)]


def write_sft(records: list[dict[str, Any]], out_dir: Path) -> Path:
    """`out_dir/sft.jsonl` and the same records as a Hugging Face dataset in `out_dir/hf`."""
    try:
        import datasets
    except ImportError:
        raise ValueError("writing the Hugging Face dataset folder needs the optional "
                         "extra: pip install 'undertow[datasets]'") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "sft.jsonl").open("w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
    datasets.Dataset.from_list(records).save_to_disk(str(out_dir / "hf"))
    return out_dir


def _read_records(folder: Path) -> list[dict[str, Any]]:
    if (folder / "sft.jsonl").is_file():
        lines = (folder / "sft.jsonl").read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    import datasets

    dataset = datasets.load_from_disk(str(folder))
    if not isinstance(dataset, datasets.Dataset):
        raise ValueError(f"{folder} holds a dataset dictionary; give the folder that "
                         "`undertow export sft` wrote (its sft.jsonl or hf/)")
    return [dict(row) for row in dataset]


def read_sft_trees(folder: Path) -> list[Tree]:
    """The group trees of an exported SFT folder (`sft.jsonl`, or a `hf` dataset folder):
    each record's sampled spans are replayed as calls, so the trees hold the same paths,
    trainable tokens, logprobs, versions and rewards as the run's own trees."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no exported SFT folder at {folder}; write one with "
                                "`undertow export sft RUN --out DIR`")
    trees: dict[str, Tree] = {}
    for number, record in enumerate(_read_records(folder)):
        tree = trees.setdefault(record["group_id"], Tree(record["group_id"]))
        session_id, token_ids = record["session_id"], record["token_ids"]
        for start, end, sampled in _spans(list(map(bool, record["trainable"]))):
            if sampled:
                logprobs = [v if v is not None else 0.0 for v in record["logprobs"][start:end]]
                tree.add_call(f"sft-{number}-{start}", session_id, token_ids[:start],
                              token_ids[start:end], logprobs, record["weight_versions"][start:end])
        tree.close_session(session_id, record["reward"], {"instance_id": record["instance_id"]})
    return list(trees.values())
