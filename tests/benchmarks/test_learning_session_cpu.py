"""`python -m benchmarks.learning_session_cpu`: which process counts in which part, and
the CPU seconds a sampler adds up, on real processes."""

import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.learning_session_cpu import CpuSampler, Parts, descends_from

BUSY = "import time\nend = time.process_time() + {}\nwhile time.process_time() < end: pass\n"


def _child(*argv):
    """A python child whose command line ends with `argv`, once it shows in /proc."""
    child = subprocess.Popen([sys.executable, "-c", *argv])
    while argv[-1].encode() not in Path(f"/proc/{child.pid}/cmdline").read_bytes():
        time.sleep(0.01)
    return child


def test_engine_and_scaffold_count_only_under_the_rollout_process():
    scaffold = _child("import time; time.sleep(30)", "minisweagent.run.mini")
    engine = _child("import time; time.sleep(30)", "engine serve")
    try:
        assert descends_from(scaffold.pid, os.getpid())
        ours, other = Parts(os.getpid()), Parts(engine.pid)  # a sibling: not an ancestor
        assert (ours.of(scaffold.pid), ours.of(engine.pid)) == ("scaffold", "engine")
        assert ours.of(os.getpid()) == "rollout"
        assert other.of(scaffold.pid) is None and other.of(os.getpid()) is None
    finally:
        scaffold.kill()
        engine.kill()
        scaffold.wait()
        engine.wait()


def test_the_sampler_adds_up_a_busy_process_cpu_from_its_start():
    sampler = CpuSampler(os.getpid(), interval_s=0.05)
    sampler.thread.start()
    busy = _child(BUSY.format(0.6) + "import time; time.sleep(0.3)\n", "minisweagent")
    busy.wait()
    sampler.stop.set()
    sampler.thread.join()
    totals = sampler.totals()
    assert 0.5 < totals["scaffold"] < 2.0, totals
    assert totals["engine"] == totals["container"] == 0.0
