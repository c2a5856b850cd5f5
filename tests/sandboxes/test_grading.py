"""Grading: rewards from the fixture task's tests, partial credit, and tamper-proof tests."""

import pytest

from undertow.sandboxes.errors import SandboxError
from undertow.sandboxes.grading import GradingConfig, grade, patched_paths, score

ALWAYS = GradingConfig(partial_credit="always")


def test_score_rules(fixture_task):
    f2p, p2p = fixture_task.FAIL_TO_PASS, fixture_task.PASS_TO_PASS
    all_pass = dict.fromkeys((*f2p, *p2p), "passed")
    assert score(fixture_task, all_pass, GradingConfig())[:2] == (1.0, True)
    half = {**all_pass, f2p[1]: "failed"}
    assert score(fixture_task, half, GradingConfig())[0] == 0.0
    assert score(fixture_task, half, GradingConfig(), timed_out=True)[0] == 0.5
    assert score(fixture_task, half, ALWAYS)[0] == 0.5
    assert score(fixture_task, half, GradingConfig(partial_credit="never"), timed_out=True)[0] == 0
    broken = {**half, p2p[0]: "failed"}
    assert score(fixture_task, broken, ALWAYS)[0] == 0.0
    lenient = GradingConfig(partial_credit="always", zero_if_pass_to_pass_breaks=False)
    assert score(fixture_task, broken, lenient)[0] == 0.5
    missing = {test: status for test, status in all_pass.items() if test != f2p[0]}
    assert score(fixture_task, missing, GradingConfig())[:2] == (0.0, False)
    with pytest.raises(ValueError, match="partial_credit"):
        GradingConfig(partial_credit="sometimes")


def test_skipped_fail_to_pass_counts_neither_way_unless_configured(fixture_task):
    f2p, p2p = fixture_task.FAIL_TO_PASS, fixture_task.PASS_TO_PASS
    skipped = {**dict.fromkeys(f2p, "skipped"), **dict.fromkeys(p2p, "passed")}
    # The official 4.x harness: no FAIL_TO_PASS test counted, so the fraction is 1.
    assert score(fixture_task, skipped, GradingConfig())[:2] == (1.0, True)
    strict = GradingConfig(skipped_fail_to_pass_fails=True, partial_credit="always")
    assert score(fixture_task, skipped, strict)[:2] == (0.0, False)
    half = {**skipped, f2p[0]: "passed"}
    assert score(fixture_task, half, strict)[0] == 0.5
    assert score(fixture_task, {**half, p2p[0]: "skipped"}, strict)[0] == 0.5


def test_patched_paths(fixture_task):
    assert patched_paths(fixture_task.test_patch) == ["tests/test_fixes.py", "tests/test_ops.py"]


@pytest.mark.docker
class TestGradeInDocker:
    async def _grade(self, docker_connection, docker_run, fixture_image, task, diff, **options):
        return await grade(docker_connection, task, diff, run=docker_run, image=fixture_image,
                           **options)

    async def test_gold_patch_scores_one(self, docker_connection, docker_run, fixture_image,
                                         fixture_task):
        verdict = await self._grade(docker_connection, docker_run, fixture_image, fixture_task,
                                    fixture_task.patch)
        assert (verdict.reward, verdict.resolved) == (1.0, True)
        assert set(verdict.tests.values()) == {"passed"}

    async def test_empty_diff_scores_zero(self, docker_connection, docker_run, fixture_image,
                                          fixture_task):
        verdict = await self._grade(docker_connection, docker_run, fixture_image, fixture_task,
                                    "", config=ALWAYS)
        assert (verdict.reward, verdict.resolved) == (0.0, False)
        assert [verdict.tests[t] for t in fixture_task.FAIL_TO_PASS] == ["failed", "failed"]

    async def test_half_fix_earns_half_credit_on_timeout(self, docker_connection, docker_run,
                                                         fixture_image, fixture_task,
                                                         task_set_dir):
        half = (task_set_dir / "half_fix.diff").read_text()
        timed_out = await self._grade(docker_connection, docker_run, fixture_image, fixture_task,
                                      half, timed_out=True)
        assert (timed_out.reward, timed_out.num_fail_to_pass_passed) == (0.5, 1)
        finished = await self._grade(docker_connection, docker_run, fixture_image, fixture_task,
                                     half)
        assert finished.reward == 0.0 and "not resolved" in finished.reason

    async def test_broken_pass_to_pass_zeroes_partial_credit(
            self, docker_connection, docker_run, fixture_image, fixture_task, task_set_dir):
        half = (task_set_dir / "half_fix.diff").read_text()
        breaks_add = half + (
            "diff --git a/minimath/__init__.py b/minimath/__init__.py\n"
            "--- a/minimath/__init__.py\n+++ b/minimath/__init__.py\n"
            "@@ -1,2 +1,3 @@\n from minimath.ops import add, clamp\n"
            " from minimath.stats import mean\n+add = lambda a, b: a - b  # noqa\n")
        verdict = await self._grade(docker_connection, docker_run, fixture_image, fixture_task,
                                    breaks_add, config=ALWAYS)
        assert verdict.reward == 0.0
        assert set(verdict.broken_pass_to_pass) == set(fixture_task.PASS_TO_PASS)
        assert "PASS_TO_PASS broke" in verdict.reason

    async def test_diff_that_does_not_apply_scores_zero_with_reason(
            self, docker_connection, docker_run, fixture_image, fixture_task):
        bogus = fixture_task.patch.replace("return min(low, max(value, high))", "return nothing")
        verdict = await self._grade(docker_connection, docker_run, fixture_image, fixture_task,
                                    bogus)
        assert verdict.reward == 0.0 and "does not apply" in verdict.reason
        assert "minimath/ops.py" in verdict.reason

    async def test_agent_edits_to_held_back_tests_cannot_change_the_verdict(
            self, docker_connection, docker_run, fixture_image, fixture_task):
        # The agent "fixes" nothing, but writes its own always-passing versions of the tests.
        cheat = (
            "diff --git a/tests/test_fixes.py b/tests/test_fixes.py\nnew file mode 100644\n"
            "--- /dev/null\n+++ b/tests/test_fixes.py\n@@ -0,0 +1,4 @@\n"
            "+def test_clamp():\n+    pass\n+def test_mean():\n+    pass\n"
            "diff --git a/tests/test_ops.py b/tests/test_ops.py\n"
            "--- a/tests/test_ops.py\n+++ b/tests/test_ops.py\n@@ -1,5 +1,5 @@\n"
            " from minimath import add\n \n \n def test_add():\n-    assert add(2, 3) == 5\n"
            "+    assert True\n")
        verdict = await self._grade(docker_connection, docker_run, fixture_image, fixture_task,
                                    cheat, config=ALWAYS)
        assert verdict.reward == 0.0
        assert [verdict.tests[t] for t in fixture_task.FAIL_TO_PASS] == ["failed", "failed"]
        assert "does not apply" not in verdict.reason

    async def test_tests_that_hang_are_stopped(self, docker_connection, docker_run,
                                               fixture_image, fixture_task):
        from dataclasses import replace

        slow = replace(fixture_task, timeout_s=2.0, test_cmd="sleep 60")
        verdict = await self._grade(docker_connection, docker_run, fixture_image, slow,
                                    fixture_task.patch)
        assert verdict.reward == 0.0 and "ran past 2 s" in verdict.reason
        assert set(verdict.tests.values()) == {"missing"}

    async def test_a_run_that_never_reaches_the_tests_is_no_verdict_on_the_diff(
            self, docker_connection, docker_run, fixture_image, fixture_task):
        # A set-up command that ends the script before its start marker (or an output lost
        # on its way back) says nothing of the diff: an error of the grading, not a reward
        # of 0 that a learner would train on.
        from dataclasses import replace

        broken = replace(fixture_task, eval_commands=("echo setting up", "exit 3"))
        with pytest.raises(SandboxError, match="without the start marker") as raised:
            await self._grade(docker_connection, docker_run, fixture_image, broken,
                              fixture_task.patch)
        assert "exit code 3" in str(raised.value) and "setting up" in str(raised.value)
