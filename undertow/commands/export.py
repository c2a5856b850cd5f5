"""`undertow export predictions|sft RUN`: a rollout run's results for tools outside Undertow.

`predictions` writes SWE-bench's predictions JSONL, `sft` the sessions as chat-format
records with token IDs that `undertow sft --data DIR` reads back; both formats are
`undertow/exports.py`'s.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from undertow.commands import Commands

if TYPE_CHECKING:
    from undertow.exports import Decode


def add(commands: Commands) -> None:
    export = commands.add_parser("export", help="a rollout run's predictions or SFT data"
                                 ).add_subparsers(dest="action", required=True)
    predictions = export.add_parser("predictions", help="SWE-bench predictions JSONL")
    predictions.add_argument("run", type=Path, help="rollout run folder (holding summary.json)")
    predictions.add_argument("--out", type=Path, required=True, help="preds.jsonl to write")
    predictions.add_argument("--select", choices=("best", "all"), default="best",
                             help="best: one per instance, the best of its group (default); "
                             "all: one per session")
    predictions.add_argument("--model-name", default=None,
                             help="model_name_or_path (default: undertow-<scaffold>)")
    predictions.set_defaults(handler=_predictions)
    sft = export.add_parser("sft", help="sessions as chat-format records with token IDs and "
                            "rewards (JSONL + Hugging Face dataset folder)")
    sft.add_argument("run", type=Path, help="rollout run folder")
    sft.add_argument("--out", type=Path, required=True, help="folder to write")
    sft.add_argument("--store", type=Path, default=None,
                     help="the run's tree store (default: RUN/gateway/store, the embedded one)")
    sft.add_argument("--model", type=Path, default=None,
                     help="model directory whose tokenizer decodes the text (default: the "
                     "tiny model `undertow rollout` built next to the run)")
    sft.add_argument("--min-reward", type=float, default=1.0,
                     help="keep sessions at or above this reward (default 1: resolved)")
    sft.set_defaults(handler=_sft)


def _predictions(args: argparse.Namespace) -> int:
    from undertow.exports import export_predictions

    report = export_predictions(args.run, args.out, select=args.select,
                                model_name=args.model_name)
    print(report.summary())
    return 0


def _decoder(model_dir: Path) -> Decode:
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}; give --model DIR")
    tokenizer = Tokenizer.from_file(str(path))
    return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=False)


def _sft(args: argparse.Namespace) -> int:
    from undertow.exports import sft_records, write_sft
    from undertow.learner.trees import load_store_trees

    store = args.store or args.run / "gateway" / "store"
    model = args.model or args.run.parent / "model-tiny"
    records = sft_records(load_store_trees(store), args.min_reward, _decoder(model))
    write_sft(records, args.out)
    sessions = {(r["group_id"], r["session_id"]) for r in records}
    print(f"wrote {len(records)} paths of {len(sessions)} sessions (reward >= "
          f"{args.min_reward:g}) to {args.out / 'sft.jsonl'} and {args.out / 'hf'}")
    return 0
