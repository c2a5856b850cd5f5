"""``python -m calclang FILE`` runs a program and prints its output."""

import sys

from calclang import CalcError, run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: calclang FILE", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as file:
        source = file.read()
    try:
        for line in run(source):
            print(line)
    except CalcError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
