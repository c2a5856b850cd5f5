"""The composition root's errors (`undertow/`: the command line, its commands and the
wiring of a run), in one small hierarchy. The parts have their own: `gateway/errors.py`,
`adapters/errors.py`, `learner/errors.py`, `sandboxes/errors.py`.

    CommandError              a command cannot do what it was asked; the message says what to do
    ├── SessionCommandError   (also a ValueError) `undertow session`: no token, a refused call
    └── NotFoundError         (also a LookupError) `undertow ui`: no such run, step, group, session

Wrong configuration values are `ValueError`s naming the value (`config.py`), as everywhere.
"""


class CommandError(Exception):
    """Base class of every error raised by the `undertow` package itself."""
