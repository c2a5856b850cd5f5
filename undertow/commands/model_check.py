"""`undertow model check DIR`: does token truth hold with this model directory's own chat
template and tokenizer? Which tool-call and reasoning parser match it, what are its stop
and EOS IDs, and what to set if something does not hold (`gateway/front/model_check.py`). No
engine runs; run it before spending GPU hours. Exit status 0 when token truth holds,
1 when it does not.
"""

from __future__ import annotations

from pathlib import Path

from undertow.commands import subcommands_of


def add(commands) -> None:
    check = subcommands_of(commands, "model").add_parser(
        "check", help="check token truth, parsers and stop IDs of a local model directory")
    check.add_argument("model", type=Path, metavar="DIR", help="Hugging Face model directory")
    check.add_argument("--turns", type=int, default=12,
                       help="turns of the agent session played through the template")
    check.set_defaults(handler=_check)


def _check(args) -> int:
    from undertow.gateway.front.model_check import check_model

    if args.turns < 2:
        raise ValueError(f"--turns {args.turns}: a session needs at least 2 turns")
    result = check_model(args.model, num_turns=args.turns)
    print(result.report())
    return 0 if result.holds else 1
