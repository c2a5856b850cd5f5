"""Reward functions that fail for real, for `undertow train` tests of reward integrity.

`every_third_crashes`: counts its calls in the file the task's `counter` field names
and raises on every third one (the 1st, 4th, 7th, ...), so that some sessions of most
groups end in `error:reward` and are re-run; the others score 1 when the reply is
shorter than 12 characters, else 0. `always_crashes`: a grader that is broken.
"""

from pathlib import Path


def every_third_crashes(messages, task):
    counter = Path(task["counter"])
    number = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(number + 1))
    if number % 3 == 0:
        raise RuntimeError(f"grader crashed on call {number}")
    return len(messages[-1]["content"]) < 12


def always_crashes(messages, task):
    raise RuntimeError("the grading command is broken")
