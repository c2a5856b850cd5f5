"""The run's log, `RUN/train.log`: the details that the run's output leaves out.

`undertow train` prints one line a step (`metrics_log.format_step`), which counts what the
step dropped and re-ran; which groups those were, and why, go here, one line each, with
the time (UTC) and the step: e.g. `2026-12-07T01:30:00Z step 4: dropped group
g000037-r0: every session trained would enter with reward 1.0 (no signal)`. The file is appended to
across resumes, like the run's other logs, and flushed line by line.
"""

from __future__ import annotations

import time
from pathlib import Path

RUN_LOG_FILE = "train.log"


class RunLog:
    """Appends lines to `RUN/train.log` (`run_dir`)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / RUN_LOG_FILE

    def write(self, step: int, message: str) -> None:
        """One line about step `step`."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(f"{stamp} step {step}: {message}\n")
