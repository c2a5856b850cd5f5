"""The rollout runner against a gateway (scripted engine) and real Docker sandboxes.

Scaffolds here are tiny shell scripts through the `command` adapter: one crashes, one
hangs, one floods its output; one leaves half a fix and hangs (partial credit at the
cut-off); and an interrupted run (SIGINT) must close its sessions and remove its
containers.
"""

import asyncio
import dataclasses
import json
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest

from undertow.adapters.command import CommandScaffold
from undertow.adapters.rollout import Rollout, RolloutConfig, failure_reason
from undertow.sandboxes.sandbox import SandboxConfig

from .conftest import BUNDLED, run_containers

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the fixtures' loop

CALL_GATEWAY = (
    "python3 -c \"import json, os, urllib.request as u; r = u.Request("
    "os.environ['OPENAI_BASE_URL'] + '/chat/completions', json.dumps({'model': 'm', "
    "'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 8}).encode(), "
    "{'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], "
    "'Content-Type': 'application/json'}); print(u.urlopen(r).read()[:80])\"")


@pytest.mark.docker
async def test_crash_hang_and_flood_do_not_stop_the_run(scripted_gateway, bundled_tasks,
                                                        connection, tmp_path):
    crash, hang, flood = sorted(bundled_tasks)[:3]
    command = (f"case {{instance_id}} in\n"
               f"  {crash}) {CALL_GATEWAY}; echo about to crash; exit 3 ;;\n"
               f"  {hang}) sleep 600 ;;\n"
               f"  *) yes flood ;;\nesac")
    scaffold = CommandScaffold(command, max_output_bytes=2**20)
    tasks = [bundled_tasks[name] for name in (crash, hang, flood)]
    config = RolloutConfig(group_size=1, concurrency=3, timeout_s=5, out_dir=tmp_path,
                           progress_interval_s=0)
    rollout = Rollout(tasks, scaffold, scripted_gateway.admin, connection, config)
    summary = await rollout.run()

    causes = {r.instance_id: r.cause for r in summary.sessions}
    assert causes == {crash: "crashed", hang: "timeout", flood: "output_flood"}
    by_task = {r.instance_id: r for r in summary.sessions}
    assert by_task[crash].exit_code == 3 and "about to crash" in by_task[crash].log_tail
    assert by_task[crash].num_calls == 1
    assert summary.failures() == {"crashed": 1, "output_flood": 1}
    for result in summary.sessions:
        session = await scripted_gateway.admin.session(result.session_id)
        assert session["closed"] and session["reward"] == 0.0
        assert session["meta"]["cause"] == result.cause
        assert session["meta"]["grade_reason"]  # graded despite the failure
    assert run_containers(rollout.run_id) == []
    assert (tmp_path / rollout.run_id / "summary.json").exists()


# Makes `**` right-associative only: one FAIL_TO_PASS test of calclang-2's two.
HALF_FIX = (
    "python3 - <<'PY'\n"
    "import pathlib\n"
    "path = pathlib.Path('calclang/parser.py')\n"
    "old = '        while token := self.match(\"**\"):\\n"
    "            left = ast.Binary(token.line, \"**\", left, self.call())'\n"
    "new = '        if token := self.match(\"**\"):\\n"
    "            return ast.Binary(token.line, \"**\", left, self.power())'\n"
    "assert old in path.read_text()\n"
    "path.write_text(path.read_text().replace(old, new))\n"
    "PY\n")


@pytest.mark.docker
async def test_timeout_is_graded_on_the_sandbox_at_the_cut_off(scripted_gateway, bundled_tasks,
                                                               connection, tmp_path):
    # The rest of the fix would come after the cut-off and must not count.
    task = bundled_tasks["calclang__calclang-2"]
    rest = "git checkout -q -- . && git apply <<'P'\n" + task.patch + "P\n"
    scaffold = CommandScaffold(f"cd {{repo_dir}}\n{HALF_FIX}sleep 600\n{rest}",
                               where="sandbox")
    config = RolloutConfig(timeout_s=15, out_dir=tmp_path, progress_interval_s=0)
    rollout = Rollout([task], scaffold, scripted_gateway.admin, connection, config)
    [result] = (await rollout.run()).sessions

    assert result.cause == "timeout" and result.reward_source == "partial_credit"
    assert result.tests["tests/test_issue_2.py::test_power_is_right_associative"] == "passed"
    assert result.tests["tests/test_issue_2.py::test_negative_exponent"] == "failed"
    assert result.reward == result.partial_credit == 0.5
    assert "self.power())" in result.details["diff"]
    assert "self.unary())" not in result.details["diff"]
    session = await scripted_gateway.admin.session(result.session_id)
    assert session["closed"] and session["reward"] == 0.5
    assert run_containers(rollout.run_id) == []


@pytest.mark.docker
async def test_tree_estimate_for_a_timed_out_session(scripted_gateway, bundled_tasks,
                                                     connection, tmp_path):
    # Both sessions make the same call (so they share its tree nodes); the first to
    # claim the lock applies the gold patch and exits, the other hangs.
    task = bundled_tasks["calclang__calclang-2"]
    patch_file = tmp_path / "gold.diff"
    patch_file.write_text(task.patch)
    command = (f"{CALL_GATEWAY}\nif mkdir {tmp_path}/first 2>/dev/null; then docker exec -i "
               f"-w {{repo_dir}} {{container}} git apply < {patch_file}; else sleep 600; fi")
    config = RolloutConfig(group_size=2, concurrency=2, timeout_s=10, out_dir=tmp_path,
                           timeout_value="tree_estimate", progress_interval_s=0)
    rollout = Rollout([task], CommandScaffold(command), scripted_gateway.admin, connection,
                      config)
    finished, cut_off = sorted((await rollout.run()).sessions, key=lambda r: r.cause)
    assert (finished.cause, finished.reward) == ("exited", 1.0)
    assert cut_off.cause == "timeout" and cut_off.partial_credit == 0.0
    assert cut_off.reward_source == "tree_estimate" and cut_off.reward == 1.0
    assert cut_off.tree_value["num_sessions"] == 1
    session = await scripted_gateway.admin.session(cut_off.session_id)
    assert session["closed"] and session["reward"] == 1.0


def heeds_sigint() -> None:
    """In the child, before it runs: SIGINT at its default, for a suite started where it is
    ignored (a background job of a shell without job control passes it on ignored, and
    Python then leaves it ignored: the rollout would never see the interrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def interrupted_rollout(gateway, tasks: Path, out_dir: Path, group_size: int,
                              settle_s: float, exit_within_s: float,
                              signal_number: int = signal.SIGINT) -> bytes:
    """Runs `undertow rollout` of one task (a `sleep 600` scaffold) until all `group_size`
    sessions run, waits `settle_s`, sends `signal_number`, and returns its output once it
    has exited with 128 + 2 (SIGINT: 130) or 128 + 15 (SIGTERM); fails with that output if
    it has not exited within `exit_within_s`."""
    token = gateway.admin._headers["Authorization"].removeprefix("Bearer ")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "undertow.cli", "rollout", "--tasks", str(tasks),
        "--scaffold", "command", "--gateway", gateway.url, "--out", str(out_dir),
        "num_tasks=1", f"group_size={group_size}", f"concurrency={group_size}",
        "timeout_s=600", "progress_interval_s=1", "scaffold_options.command=sleep 600",
        env={**os.environ, "UNDERTOW_ADMIN_TOKEN": token},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        preexec_fn=heeds_sigint)
    output = b""
    while f"{group_size} running".encode() not in output:  # every session has its slot
        line = await asyncio.wait_for(process.stdout.readline(), 120)
        assert line, output.decode()
        output += line
    await asyncio.sleep(settle_s)
    process.send_signal(signal_number)
    try:
        output += await asyncio.wait_for(process.stdout.read(), exit_within_s)
    except TimeoutError:  # say what it was doing, not only that it hung
        process.kill()
        output += await process.stdout.read()
        pytest.fail(f"the rollout had not exited {exit_within_s:.0f} s after "
                    f"{signal.Signals(signal_number).name}; its output:\n{output.decode()}")
    assert await process.wait() == 128 + signal_number, output.decode()
    return output


@pytest.mark.docker
@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM],
                         ids=["SIGINT", "SIGTERM"])
async def test_an_interrupt_closes_sessions_and_removes_containers(scripted_gateway, tmp_path,
                                                                    signal_number):
    output = await interrupted_rollout(scripted_gateway, BUNDLED, tmp_path, group_size=2,
                                       settle_s=1, exit_within_s=120,
                                       signal_number=signal_number)
    sessions = (await scripted_gateway.admin._call("GET", "/admin/sessions"))["sessions"]
    assert len(sessions) == 2
    assert all(s["closed"] and s["meta"]["cause"] == "interrupted" for s in sessions), (
        [(s["meta"].get("cause"), s["meta"].get("error")) for s in sessions], output.decode())
    assert run_containers(sessions[0]["meta"]["run"]) == []


@pytest.mark.docker
async def test_sigint_during_a_first_image_build_exits_at_once(scripted_gateway, tmp_path):
    """Interrupted while its task's image is still being built (minutes on first use), the
    rollout closes its session and exits at once: it does not wait for the Docker call
    still running in a worker thread, whose answer nobody wants any more (before the fix
    it waited for the build's `sleep 300`)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "repos").symlink_to(BUNDLED / "repos")
    first = json.loads((BUNDLED / "tasks.jsonl").read_text().splitlines()[0])
    first["pre_install"] = [f"sleep 300  # {uuid.uuid4().hex}: no build cache"]
    (tasks / "tasks.jsonl").write_text(json.dumps(first) + "\n")
    output = await interrupted_rollout(scripted_gateway, tasks, tmp_path, group_size=1,
                                       settle_s=5, exit_within_s=60)
    [session] = (await scripted_gateway.admin._call("GET", "/admin/sessions"))["sessions"]
    assert session["closed"] and session["meta"]["cause"] == "interrupted", output.decode()


@pytest.mark.docker
async def test_failures_of_undertow_are_rerun_closed_as_such_and_counted(
        scripted_gateway, bundled_tasks, connection, tmp_path):
    """A task whose image cannot be had and one whose grading crashes (its test patch no
    longer applies): every attempt fails for real, each slot is re-run as a new session of
    its group up to max_attempts, and each failed session is closed marked as Undertow's."""
    first, second = sorted(bundled_tasks)[:2]
    no_image = dataclasses.replace(bundled_tasks[first],
                                   image="undertow/no-such-image:missing")
    bad_grader = dataclasses.replace(bundled_tasks[second],
                                     test_patch="--- a/nowhere\n+++ b/nowhere\n@@ garbage\n")
    config = RolloutConfig(group_size=1, concurrency=2, timeout_s=60, out_dir=tmp_path,
                           progress_interval_s=0, max_attempts=2)
    rollout = Rollout([no_image, bad_grader], CommandScaffold("true"), scripted_gateway.admin,
                      connection, config)
    summary = await rollout.run()

    assert sorted((r.instance_id, r.attempt, r.cause) for r in summary.sessions) == [
        (first, 0, "error:image"), (first, 1, "error:image"),
        (second, 0, "error:grade"), (second, 1, "error:grade")]
    assert summary.infra_failures() == {"error:image": 2, "error:grade": 2}
    assert summary.num_reruns == 2 and summary.outcomes == []
    assert len({r.session_id for r in summary.sessions}) == 4
    for result in summary.sessions:
        session = await scripted_gateway.admin.session(result.session_id)
        assert session["closed"] and session["meta"]["infra_failure"] is True
        assert session["group"] == rollout.group_name(
            no_image if result.instance_id == first else bad_grader)
    assert run_containers(rollout.run_id) == []


@pytest.mark.docker
async def test_start_commands_run_before_the_scaffold_and_a_failing_one_is_undertows(
        scripted_gateway, bundled_tasks, connection, tmp_path):
    """Start commands (SWE-smith's checkout of the instance branch) run in the session's
    sandbox before the scaffold, recorded in its sandbox.log; one that fails ends the
    session as a failure of Undertow's (`error:setup`), naming the task and the command."""
    first, second = sorted(bundled_tasks)[:2]
    prepared = dataclasses.replace(bundled_tasks[first],
                                   start_commands=("echo ready > /tmp/start-marker",))
    broken = dataclasses.replace(bundled_tasks[second], start_commands=("exit 7",))
    config = RolloutConfig(group_size=1, concurrency=2, timeout_s=60, out_dir=tmp_path,
                           progress_interval_s=0, max_attempts=1)
    rollout = Rollout([prepared, broken], CommandScaffold("docker exec {container} cat "
                                                          "/tmp/start-marker"),
                      scripted_gateway.admin, connection, config)
    summary = await rollout.run()

    by_task = {r.instance_id: r for r in summary.sessions}
    assert (by_task[first].cause, by_task[first].error) == ("exited", "")
    assert "ready" in by_task[first].log_tail
    assert by_task[second].cause == "error:setup" and by_task[second].infra_failure
    assert f"task {second}: start command 'exit 7' exited with code 7" in by_task[second].error
    sessions = tmp_path / rollout.run_id / "sessions"
    ok_log = (sessions / by_task[first].session_id / "sandbox.log").read_text()
    assert "$ echo ready > /tmp/start-marker\n# exit code 0" in ok_log
    broken_log = (sessions / by_task[second].session_id / "sandbox.log").read_text()
    assert "$ exit 7\n# exit code 7" in broken_log
    assert broken_log.endswith(f"# error:setup: {by_task[second].error}\n")
    assert run_containers(rollout.run_id) == []


@pytest.mark.docker
async def test_a_sandbox_that_cannot_start_says_why_in_the_summary_and_its_log(
        scripted_gateway, bundled_tasks, connection, tmp_path):
    """Every `error:*` carries its reason: a container Docker refuses to create (its
    network does not exist) is `error:sandbox` with Docker's answer, in the session's
    record, the run's summary.json and the session's sandbox.log."""
    task = bundled_tasks[sorted(bundled_tasks)[0]]
    config = RolloutConfig(timeout_s=60, out_dir=tmp_path, progress_interval_s=0,
                           max_attempts=1,
                           sandbox=SandboxConfig(network="undertow-no-such-network"))
    rollout = Rollout([task], CommandScaffold("true"), scripted_gateway.admin, connection,
                      config)
    [result] = (await rollout.run()).sessions
    assert result.cause == "error:sandbox"
    assert "could not start a container" in result.error
    assert "undertow-no-such-network" in result.error
    summary = json.loads((tmp_path / rollout.run_id / "summary.json").read_text())
    assert [s["error"] for s in summary["sessions"]] == [result.error]
    log = tmp_path / rollout.run_id / "sessions" / result.session_id / "sandbox.log"
    assert log.read_text() == f"# error:sandbox: {result.error}\n"
    session = await scripted_gateway.admin.session(result.session_id)
    assert session["meta"]["error"] == result.error and session["meta"]["infra_failure"]


async def test_a_failure_without_a_message_says_where_it_was_raised():
    def wait_for_docker():
        raise TimeoutError

    def start():
        try:
            wait_for_docker()
        except TimeoutError as error:
            raise RuntimeError("the sandbox did not start") from error

    with pytest.raises(RuntimeError) as raised:
        start()
    assert failure_reason(raised.value) == (
        "RuntimeError: the sandbox did not start; from TimeoutError: (no message) raised at "
        "test_rollout.py:" f"{wait_for_docker.__code__.co_firstlineno + 1} in wait_for_docker")


@pytest.mark.docker
async def test_a_relative_out_dir_gives_the_scaffold_its_own_session_folder(
        scripted_gateway, bundled_tasks, connection, tmp_path, monkeypatch):
    # Each scaffold runs in its session's folder: a relative path handed to it
    # (mini-swe-agent's `-o .../trajectory.json`) would land one folder deeper.
    monkeypatch.chdir(tmp_path)
    scaffold = CommandScaffold("echo written > {session_dir}/marker.txt")
    config = RolloutConfig(group_size=1, concurrency=1, timeout_s=30, out_dir="rel-out",
                           progress_interval_s=0)
    rollout = Rollout([bundled_tasks[sorted(bundled_tasks)[0]]], scaffold,
                      scripted_gateway.admin, connection, config)
    [session] = (await rollout.run()).sessions
    marker = tmp_path / "rel-out" / rollout.run_id / "sessions" / session.session_id
    assert (marker / "marker.txt").read_text() == "written\n"
