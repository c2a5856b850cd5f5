"""`undertow doctor`: what a run (or the test suite) needs, and the command that fixes each
missing piece; the checks are `undertow/doctor.py`'s."""

import argparse
import os
from pathlib import Path

from undertow.commands import Commands, docker_url_from_env


def add(commands: Commands) -> None:
    doctor = commands.add_parser(
        "doctor", help="check what a run needs; print the command that fixes each missing piece")
    doctor.add_argument("--for", dest="purpose", choices=("run", "test"), default="run",
                        help="run: `undertow train` and rollouts; test: also the vLLM, npm "
                        "agents and OpenHands set-ups that the test suite uses")
    doctor.add_argument("--model", type=Path, default=None, help="also check this model directory")
    doctor.set_defaults(handler=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from undertow.doctor import main

    return main(args.purpose, args.model, docker_url_from_env(),
                os.environ.get("UNDERTOW_VLLM_PYTHON"))
