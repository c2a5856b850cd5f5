"""`undertow ui` driven in a real headless browser (Debian's chromium through Playwright),
on a real run directory: a short `undertow train` (built-in engine, gateway, learner,
the scripted rollout source of the e2e tests). The tests click runs -> run -> step ->
session -> tree -> session, overlay two runs, open a half-written run, and watch a live
gateway's sessions; screenshots of each view are kept in the test's temporary folder."""

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from undertow.learner.trees import load_store_tree

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
ADMIN_TOKEN = "ui-test-admin-token"


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        raise RuntimeError("no chromium on the PATH: `make system-packages` installs Debian's "
                           "(system-packages.txt); Playwright's own download is never used")
    return path


def _start(command: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "ab") as handle:
        return subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_for_url(process: subprocess.Popen, log: Path, prefix: str) -> str:
    """The URL a server prints on a line starting with `prefix` (it listens on port 0)."""
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(prefix) and "http://" in line:
                return "http://" + line.split("http://", 1)[1].split()[0].rstrip(",")
        assert process.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    pytest.fail(f"no {prefix!r} line with a URL in {log}:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def runs_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """`runs/a` from a real two-step `undertow train`; `runs/b` a copy of it (for the
    overlay); `runs/broken` a half-written run (a torn metrics line, nothing else)."""
    runs = tmp_path_factory.mktemp("ui") / "runs"
    log = runs.parent / "train.log"
    command = [sys.executable, "-m", "undertow.cli", "train", "--run-dir", str(runs / "a"),
               f"run.model_dir={tiny_model_dir}", "learner.num_steps=2", "learner.group_size=2",
               "learner.max_staleness=0", "learner.lr=0.001",
               "rollout.source=tests.e2e.scripted_rollouts:make_run_group",
               "logging.trackers=[tensorboard]"]
    process = _start(command, log)
    try:
        assert process.wait(timeout=TIMEOUT_S) == 0, log.read_text()[-3000:]
    finally:
        _stop(process)
    shutil.copytree(runs / "a", runs / "b")
    broken = runs / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text('{"step": 1, "weight_version": 1, "loss": 0.5}\n'
                                          '{"step": 2, "weight_ver')
    return runs


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=_chromium(),
                                              args=["--no-sandbox", "--disable-gpu"])
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def viewer(runs_dir):
    log = runs_dir.parent / "ui.log"
    process = _start([sys.executable, "-m", "undertow.cli", "ui", "--runs", str(runs_dir),
                      "--port", "0"], log)
    try:
        yield _wait_for_url(process, log, "undertow ui:")
    finally:
        _stop(process)


def _open(page, url: str, route: str):
    page.goto(f"{url}/{route}")
    page.wait_for_selector(f'body[data-ready="{route}"]')


def _click_to(page, selector: str, route_prefix: str):
    page.click(selector)
    page.wait_for_function(
        "prefix => (document.body.dataset.ready || '').startsWith(prefix)", arg=route_prefix)


def test_train_records_each_steps_groups_and_feeds_its_trackers(runs_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = [json.loads(line) for line in
             (runs_dir / "a" / "steps.jsonl").read_text().splitlines()]
    assert [(r["step"], r["group_ids"]) for r in lines] == [(1, ["g000000-r0"]),
                                                            (2, ["g000001-r0"])]
    accumulator = EventAccumulator(str(runs_dir / "a" / "trackers" / "tensorboard"))
    accumulator.Reload()
    metrics = [json.loads(line) for line in
               (runs_dir / "a" / "metrics.jsonl").read_text().splitlines()]
    got = [(e.step, e.value) for e in accumulator.Scalars("train/reward_mean")]
    assert got == [(r["step"], pytest.approx(r["reward_mean"])) for r in metrics]


def test_click_runs_step_session_tree(viewer, runs_dir, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    _open(page, viewer, "#/")
    rows = page.locator('[data-testid="runs"] tr[data-run]')
    assert rows.count() == 3
    run_a = page.locator('tr[data-run="a"]')
    assert "done" in run_a.inner_text() and "\t2\t" in run_a.inner_text()
    page.screenshot(path=str(tmp_path / "runs.png"), full_page=True)

    _click_to(page, 'tr[data-run="a"] a', "#/run/a")
    assert page.locator('[data-testid="charts"] .chart').count() == 9
    reward_chart = page.locator('svg[data-chart="reward (mean ± spread)"]')
    assert reward_chart.locator("circle").count() == 2   # one point per step
    assert reward_chart.locator("polygon").count() == 1  # the spread band
    steps = page.locator('[data-testid="steps"] tr')
    assert steps.count() == 3   # header and two steps
    assert '"group_size": 2' in page.locator('[data-testid="config"]').inner_text()
    page.screenshot(path=str(tmp_path / "run.png"), full_page=True)

    _click_to(page, 'a[href="#/run/a/step/1"]', "#/run/a/step/1")
    assert "groups as the learner recorded them" in page.inner_text("main")
    sessions = page.locator('section[data-group="g000000-r0"] [data-testid="sessions"] tr')
    assert sessions.count() == 3
    texts = [sessions.nth(i).inner_text() for i in (1, 2)]
    tree = load_store_tree(runs_dir / "a" / "store" / "g000000-r0.jsonl")
    rewards = {sid: p.reward for sid, p in tree.sessions.items()}
    assert sorted(rewards.values()) == [0.0, 1.0]
    advantages = sorted(page.locator('[data-testid="advantage"]').all_inner_texts())
    assert advantages == ["-1.0000", "1.0000"]
    assert all(t.split("\t")[0] in rewards for t in texts)
    page.screenshot(path=str(tmp_path / "step.png"), full_page=True)

    winner = next(sid for sid, reward in rewards.items() if reward == 1.0)
    _click_to(page, f'a:text-is("{winner}")', f"#/run/a/session/g000000-r0/{winner}")
    calls = page.locator('[data-testid="calls"] .call')
    assert calls.count() == 2   # the scripted source makes two chat turns per session
    assert "Fix the off-by-one error" in page.locator('[data-testid="prompt"]').first.inner_text()
    first = calls.first.locator(".tok")
    assert first.count() == 8   # max_tokens=8
    first.nth(0).hover()
    tip = page.locator("#tip")
    tip.wait_for(state="visible")
    node = tree.nodes[tree.calls[[c.session_id for c in tree.calls].index(winner)].leaf]
    assert f"id {node.token_ids[-8]}" in tip.inner_text()
    assert f"logprob {node.logprobs[-8]:.4f}" in tip.inner_text()
    assert "weight v0" in tip.inner_text()
    page.screenshot(path=str(tmp_path / "session.png"), full_page=True)

    _click_to(page, 'a[href="#/run/a/tree/g000000-r0"]', "#/run/a/tree/g000000-r0")
    rects = page.locator('[data-testid="tree"] rect')
    assert rects.count() == len(tree.nodes) - 1   # every node but the empty root
    loser = next(sid for sid, reward in rewards.items() if reward == 0.0)
    page.screenshot(path=str(tmp_path / "tree.png"), full_page=True)
    _click_to(page, f'rect[data-session="{loser}"] >> nth=0',
              f"#/run/a/session/g000000-r0/{loser}")
    assert page.locator("h1").inner_text() == f"Session {loser}"
    page.close()


def test_two_runs_overlaid(viewer, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    _open(page, viewer, "#/")
    page.check('input[aria-label="select a"]')
    page.check('input[aria-label="select b"]')
    _click_to(page, "text=overlay selected runs", "#/compare/")
    loss = page.locator('svg[data-chart="loss"]')
    assert loss.locator("polyline").count() == 2
    assert page.locator(".legend > span").all_inner_texts() == ["a", "b"]
    page.screenshot(path=str(tmp_path / "overlay.png"), full_page=True)
    page.close()


def test_half_written_run_shows_what_is_there_and_says_what_is_not(viewer, browser, tmp_path):
    page = browser.new_page()
    _open(page, viewer, "#/run/broken")
    problems = page.locator('[data-testid="problems"]').inner_text()
    assert "cut off" in problems and "no checkpoint" in problems and "no tree store" in problems
    assert page.locator('[data-testid="steps"] tr').count() == 2   # the one whole step
    page.screenshot(path=str(tmp_path / "broken.png"), full_page=True)
    _open(page, viewer, "#/run/nosuchrun")
    assert "no run 'nosuchrun'" in page.locator('[data-testid="error"]').inner_text()
    page.close()


def _admin(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}",
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def test_live_sessions_stream_without_the_token_reaching_the_browser(
        runs_dir, tiny_model_dir, browser, tmp_path):
    gateway_log, ui_log = tmp_path / "gateway.log", tmp_path / "ui.log"
    env = {"UNDERTOW_ADMIN_TOKEN": ADMIN_TOKEN}
    gateway = _start([sys.executable, "-m", "undertow.cli", "gateway", "serve", "--model",
                      str(tiny_model_dir), "--store", str(tmp_path / "store")], gateway_log, env)
    ui = None
    try:
        gateway_url = _wait_for_url(gateway, gateway_log, "undertow gateway")
        ui = _start([sys.executable, "-m", "undertow.cli", "ui", "--runs", str(runs_dir),
                     "--gateway", gateway_url, "--port", "0"], ui_log, env)
        url = _wait_for_url(ui, ui_log, "undertow ui:")
        page = browser.new_page()
        seen: list[str] = []
        page.on("request", lambda request: seen.append(
            request.url + json.dumps(request.headers)))
        _open(page, url, "#/live")
        opened = _admin(gateway_url, "/admin/sessions", {"group": "live-group"})
        row = page.locator(f'tr[data-live-session="{opened["session_id"]}"]')
        row.wait_for(timeout=30_000)
        assert "live-group" in row.inner_text()
        page.screenshot(path=str(tmp_path / "live.png"), full_page=True)
        _admin(gateway_url, f"/admin/sessions/{opened['session_id']}/close", {"reward": 1.0})
        row.wait_for(state="detached", timeout=30_000)
        assert seen and not any(ADMIN_TOKEN in entry for entry in seen)
        assert ADMIN_TOKEN not in page.content()
        page.close()
    finally:
        if ui is not None:
            _stop(ui)
        _stop(gateway)


def test_pool_run_draws_each_cells_roles_over_time(elastic_pool_run, browser, tmp_path):
    """A real pool run (3 cells, the elastic policy: the session's `elastic_pool_run`,
    tests/conftest.py, which tests/e2e/test_train_pool.py checks): its run page draws each
    cell's role between the recorded decisions."""
    from undertow.learner.elastic.loop import read_timeline

    runs = tmp_path / "runs"
    shutil.copytree(elastic_pool_run, runs / "pool")
    events = [e for e in read_timeline(runs / "pool") if isinstance(e.get("cells"), dict)]
    roles = {role for e in events for role in e["cells"].values()}
    assert {"rollout", "training"} <= roles

    ui_log = tmp_path / "ui.log"
    ui = _start([sys.executable, "-m", "undertow.cli", "ui", "--runs", str(runs), "--port", "0"],
                ui_log)
    try:
        url = _wait_for_url(ui, ui_log, "undertow ui:")
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        _open(page, url, "#/run/pool")
        cells = page.locator('[data-testid="cells"]')
        assert cells.locator("rect").count() == 3 * len(events)   # a segment per cell and event
        drawn = {cells.locator("rect").nth(i).get_attribute("data-role")
                 for i in range(cells.locator("rect").count())}
        assert drawn == roles
        cells.screenshot(path=str(tmp_path / "cells.png"))
        page.close()
    finally:
        _stop(ui)
