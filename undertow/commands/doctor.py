"""`undertow doctor`: checks what a run (or the test suite) needs; see `undertow/doctor.py`."""

import os
from pathlib import Path


def add(commands) -> None:
    doctor = commands.add_parser(
        "doctor", help="check what a run needs; print the command that fixes each missing piece")
    doctor.add_argument("--for", dest="purpose", choices=("run", "test"), default="run",
                        help="run: `undertow train` and rollouts; test: also the vLLM, npm "
                        "agents and OpenHands set-ups that the test suite uses")
    doctor.add_argument("--model", type=Path, default=None, help="also check this model directory")
    doctor.set_defaults(handler=_doctor)


def _doctor(args) -> int:
    from undertow.doctor import main

    return main(args.purpose, args.model, os.environ.get("DOCKER_HOST"),
                os.environ.get("UNDERTOW_VLLM_PYTHON"))
