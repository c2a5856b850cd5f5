"""`undertow train`: engines, gateway, rollouts and the learner, as one run.

The run config's sections are read by `undertow/run/sections.py` and the run is wired by
`undertow/run/train.py` (docs/design.md, docs/training.md). SIGTERM and Ctrl-C stop it at
a step's end; exit status 0 when done, 143 when stopped, 1 when the run failed.
"""

import argparse
import sys
from pathlib import Path

from undertow.commands import Commands


def add(commands: Commands) -> None:
    train = commands.add_parser(
        "train", help="run engines, gateway, rollouts and the learner (default: the tiny "
        "model, mini-swe-agent on the bundled tasks)")
    train.add_argument("-c", "--config", type=Path, default=None, help="run config (YAML)")
    train.add_argument("--run-dir", type=Path, default=None, help="sets run.run_dir")
    train.add_argument("--resume", action="store_true",
                       help="continue the latest checkpoint of run.run_dir")
    train.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE",
                       help="config overrides, e.g. learner.num_steps=4")
    train.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    import signal
    import threading

    from undertow.learner.checkpoint import CheckpointError
    from undertow.learner.errors import RunFailedError
    from undertow.run.sections import load_sections
    from undertow.run.train import train

    sections = load_sections(args.config, args.overrides, args.run_dir, args.resume)
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    try:
        outcome = train(sections, args.resume, stop)
    except (RunFailedError, CheckpointError) as error:   # one clear line, not a traceback
        print(f"undertow train: error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0 if outcome == "done" else 143
