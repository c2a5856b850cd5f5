"""Where a held-out learning session's CPU goes: engine, scaffold, Docker, tests, gateway.

    python -m benchmarks.learning_session_cpu [--model qwen2.5-coder-0.5b-instruct]
        [--num-tasks 8] [--group-size 2] [--concurrency 8] [--step-limit 1]

Runs `undertow rollout` of the held-out learning benchmark's sessions (`learning.py`'s
scaffold options and prompts, tasks of `learning_tasks.py` at difficulty line, seed 0,
into a scratch folder) and samples every process's CPU time (/proc/PID/stat, utime +
stime) every 0.2 s while it runs. Each process is put in one part by its command line or
cgroup: `engine` (the built-in engine), `scaffold` (mini-swe-agent, one process a
session), `rollout` (the `undertow rollout` process: gateway and rollout runner),
`docker` (dockerd, containerd and its shims, runc, the network helpers) and `container`
(whatever runs inside its containers: the agent's commands, the grading's pytest). A
process seen first after the rollout began counts from 0; one that started and ended
between two samples is missed (short `git` calls in containers), so the parts are lower
bounds. The engine and scaffolds count only under the rollout's process, containers only
those it owns; Docker's daemons serve every client of this machine, so on a shared machine
their part holds others' work too.

Writes `benchmarks/results/learning_session_cpu.json` (per part, CPU seconds per session;
the rollout's wall time, sessions, pass rate and completion tokens) and prints a table.
`--step-limit 3` (three calls a session) against the default 1 is the "fewer turns" lever.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.learner import resolve_model
from benchmarks.learning import AGENT_CONFIG
from benchmarks.learning_tasks import generate

RESULTS = Path(__file__).parent / "results" / "learning_session_cpu.json"
PARTS = ("engine", "scaffold", "rollout", "docker", "container")
DOCKER_PROGRAMS = ("dockerd", "containerd", "runc", "docker-proxy", "libnetwork", "set-ipv6",
                   "docker-init")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def descends_from(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        pid = parent_of(pid)
    return False


class Parts:
    """Which part a process belongs to (module docstring): the engine and scaffolds
    only under the rollout process, containers only those it owns (the sandboxes' label
    `undertow.owner=vm:PID`)."""

    def __init__(self, rollout_pid: int):
        self.rollout_pid = rollout_pid
        self.owners: dict[str, bool] = {}

    def of(self, pid: int) -> str | None:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            cgroup = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return None
        if pid == self.rollout_pid:
            return "rollout"
        if "/docker/" in cgroup:
            container = cgroup.split("/docker/", 1)[1].split()[0].strip("/")
            return "container" if self._ours(container) else None
        if "engine serve" in command or "minisweagent" in command:
            if descends_from(pid, self.rollout_pid):
                return "engine" if "engine serve" in command else "scaffold"
            return None
        if any(program in command.split(" ", 1)[0] for program in DOCKER_PROGRAMS):
            return "docker"
        return None

    def _ours(self, container: str) -> bool:
        if container not in self.owners:
            owner = subprocess.run(
                ["docker", "inspect", "-f", '{{index .Config.Labels "undertow.owner"}}',
                 container], capture_output=True, text=True).stdout.strip()
            self.owners[container] = owner == f"vm:{self.rollout_pid}"
        return self.owners[container]


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


class CpuSampler:
    """CPU seconds per part of the processes alive while it runs (module docstring)."""

    def __init__(self, rollout_pid: int, interval_s: float = 0.2):
        self.parts, self.interval_s = Parts(rollout_pid), interval_s
        self.baseline = {pid: cpu_seconds(pid) or 0.0 for pid in self._pids()}
        self.last: dict[int, tuple[str, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _pids() -> list[int]:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            for pid in self._pids():
                known = self.last.get(pid)
                part = known[0] if known else self.parts.of(pid)
                seconds = cpu_seconds(pid) if part else None
                if part and seconds is not None:
                    self.last[pid] = (part, seconds)

    def totals(self) -> dict[str, float]:
        totals = dict.fromkeys(PARTS, 0.0)
        for pid, (part, seconds) in self.last.items():
            totals[part] += seconds - self.baseline.get(pid, 0.0)
        return totals


def rollout(tasks: Path, out: Path, args) -> tuple[dict, dict[str, float], float]:
    """`undertow rollout` under the sampler: (its summary, CPU seconds per part, wall s)."""
    options = {"step_limit": args.step_limit, "max_tokens": args.max_tokens,
               "temperature": 1.0, "overrides": [str(AGENT_CONFIG)]}
    command = [sys.executable, "-m", "undertow.cli", "rollout", "--tasks", str(tasks),
               "--scaffold", "mini-swe-agent", "--model", str(resolve_model(args.model)),
               "--out", str(out), f"num_tasks={args.num_tasks}",
               f"group_size={args.group_size}", f"concurrency={args.concurrency}",
               "progress_interval_s=0", f"scaffold_options={json.dumps(options)}"]
    started = time.perf_counter()
    with (out.parent / "rollout.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        sampler = CpuSampler(process.pid)
        sampler.thread.start()
        code = process.wait()
        sampler.stop.set()
        sampler.thread.join()
    if code:
        raise SystemExit(f"rollout failed ({code}); see {out.parent / 'rollout.log'}")
    summary = json.loads(next(out.glob("*/summary.json")).read_text())
    return summary, sampler.totals(), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--num-tasks", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--step-limit", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        _, heldout = generate(Path(scratch) / "tasks", num_instances=4 * args.num_tasks,
                              difficulty="line")
        summary, totals, wall_s = rollout(heldout, Path(scratch) / "out", args)
    num_sessions = summary["num_sessions"]
    record = {"args": vars(args) | {"results": str(args.results)},
              "load_average_1m": [load, os.getloadavg()[0]], "wall_s": wall_s,
              "num_sessions": num_sessions, "pass_rate": summary["pass_rate"],
              "completion_tokens_per_session": summary["num_completion_tokens"] / num_sessions,
              "cpu_s_per_session": {part: totals[part] / num_sessions for part in PARTS}}
    args.results.parent.mkdir(exist_ok=True)
    args.results.write_text(json.dumps(record, indent=2))
    print("| part | CPU s per session |\n|---|---:|")
    for part, seconds in record["cpu_s_per_session"].items():
        print(f"| {part} | {seconds:.2f} |")
    print(f"{num_sessions} sessions in {wall_s:.0f} s, pass rate {summary['pass_rate']:.0%}, "
          f"{record['completion_tokens_per_session']:.0f} completion tokens a session; "
          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}; results: {args.results}")


if __name__ == "__main__":
    main()
