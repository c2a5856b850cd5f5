"""`undertow ui` driven in a real headless browser (Debian's chromium through Playwright),
on a real run directory: a short `undertow train` (built-in engine, gateway, learner,
the scripted rollout source of the e2e tests). The tests click runs -> run -> step ->
session -> tree -> session, overlay two runs, open a half-written run, and watch a live
gateway's sessions; screenshots of each view are kept in the test's temporary folder."""

import json
import math
import os
import re
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
    assert page.locator('[data-testid="charts"] .chart').count() == 13
    uniform = page.locator('svg[data-chart="groups trained with one reward (no signal)"]')
    assert uniform.locator("circle").count() == 2
    reward_chart = page.locator('svg[data-chart="reward (mean ± spread)"]')
    assert reward_chart.locator("circle").count() == 2   # one point per step
    assert reward_chart.locator("polygon").count() == 1  # the spread band
    behind = page.locator('svg[data-chart="tokens sampled ≥ 1 version behind"]')
    assert behind.locator("circle").count() == 2
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
    from undertow.cells.loop import read_timeline

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


NUM_SESSIONS = 16
LOSSES = [1.25e-4, 1.5e-4, 1.0e-4]
KLS = [-2.0e-5, 3.0e-5, 1.0e-5]


def _write_group(store_dir: Path, group: str) -> None:
    """One group of NUM_SESSIONS sessions sharing a 3-token prompt; each samples 2 tokens,
    then a second call adds 2 tokens of tool output. Written as the gateway's store writes
    its log (one event per line), without an event loop: Playwright's sync API runs one."""
    from undertow.gateway.trees.tree import Tree

    tree, events = Tree(group), []
    for n in range(NUM_SESSIONS):
        session, reply = f"s{n:02d}", [100 + n, 200 + n]
        events += [tree.add_call(f"{session}-0", session, [1, 2, 3], reply, [-0.5] * 2,
                                 [0, 0]).to_json(),
                   tree.add_call(f"{session}-1", session, [1, 2, 3, *reply, 7, 8], [9], [-0.1],
                                 [0]).to_json(),
                   {"kind": "session_close", "session_id": session, "reward": float(n % 2),
                    "meta": {"cause": "exited"}}]
    store_dir.mkdir(parents=True)
    (store_dir / f"{group}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


@pytest.fixture(scope="module")
def small_values_runs(tmp_path_factory) -> Path:
    """`runs/tiny`: three steps whose loss and KL are of order 1e-5 to 1e-4 and a group of
    NUM_SESSIONS sessions; `runs/bad`: a metrics file with a null and a list line."""
    runs = tmp_path_factory.mktemp("ui-small") / "runs"
    tiny = runs / "tiny"
    _write_group(tiny / "store", "g000000-r0")
    (tiny / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "loss": loss, "kl": kl, "reward_mean": 0.5}) + "\n"
        for step, loss, kl in zip((1, 2, 3), LOSSES, KLS, strict=True)))
    (runs / "bad").mkdir()
    (runs / "bad" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\nnull\n[1,2,3]\n')
    return runs


@pytest.fixture(scope="module")
def small_values_viewer(small_values_runs):
    log = small_values_runs.parent / "ui.log"
    process = _start([sys.executable, "-m", "undertow.cli", "ui", "--runs",
                      str(small_values_runs), "--port", "0"], log)
    try:
        yield _wait_for_url(process, log, "undertow ui:")
    finally:
        _stop(process)


def _lab(rgb: str) -> tuple[float, float, float]:
    """CIELAB (D65) of a CSS `rgb(r, g, b)` string."""
    def linear(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(float(v)) for v in rgb[rgb.index("(") + 1:rgb.index(")")].split(","))
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883
    fx, fy, fz = (t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116
                  for t in (x, y, z))
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def test_runs_list_keeps_every_run_when_one_has_records_of_the_wrong_type(
        small_values_viewer, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1300, "height": 700})
    _open(page, small_values_viewer, "#/")
    assert page.locator('[data-testid="error"]').count() == 0
    assert page.locator('[data-testid="runs"] tr[data-run]').count() == 2
    bad = page.locator('tr[data-run="bad"]').inner_text()
    assert "metrics.jsonl line 2 holds null" in bad and "metrics.jsonl line 3 holds a list" in bad
    page.screenshot(path=str(tmp_path / "runs-with-a-bad-run.png"), full_page=True)
    page.close()


def test_small_losses_read_on_the_axes_and_each_session_has_its_own_colour(
        small_values_viewer, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    _open(page, small_values_viewer, "#/run/tiny")
    for chart, values in (("loss", LOSSES), ("KL (behaviour ‖ policy)", KLS)):
        labels = page.locator(f'svg[data-chart="{chart}"] text[data-axis="y"]').all_text_contents()
        top, middle, bottom = (float(label) for label in labels)
        assert top == pytest.approx(max(values), rel=0.01)
        assert bottom == pytest.approx(min(values), rel=0.01)
        assert middle == pytest.approx((max(values) + min(values)) / 2, rel=0.01)
    page.screenshot(path=str(tmp_path / "small-values.png"), full_page=True)

    _open(page, small_values_viewer, "#/run/tiny/tree/g000000-r0")
    swatches = page.locator(".legend .swatch")
    colours = [swatches.nth(i).evaluate("el => getComputedStyle(el).backgroundColor")
               for i in range(1, swatches.count())]   # the first is the shared prompt's
    assert len(colours) == NUM_SESSIONS and len(set(colours)) == NUM_SESSIONS
    labs = [_lab(colour) for colour in colours]
    nearest = min(math.dist(p, q) for i, p in enumerate(labs) for q in labs[:i])
    assert nearest > 20, f"two sessions' colours are only {nearest:.1f} apart (CIELAB)"
    page.screenshot(path=str(tmp_path / "sixteen-sessions.png"), full_page=True)
    page.close()


def test_step_and_session_pages_show_the_same_new_prompt_tokens(small_values_viewer, browser):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    _open(page, small_values_viewer, "#/run/tiny/step/1")
    header = page.locator('[data-testid="sessions"] tr').first.locator("th").all_inner_texts()
    column = header.index("new prompt tokens")
    row = page.locator('[data-testid="sessions"] tr', has=page.locator('a:text-is("s05")'))
    on_step_page = int(row.locator("td").nth(column).inner_text())
    _open(page, small_values_viewer, "#/run/tiny/session/g000000-r0/s05")
    per_call = [int(re.search(r"\((\d+) new\)", text).group(1)) for text in
                page.locator('[data-testid="calls"] .call h3').all_inner_texts()]
    # s05 sent the shared 3-token prompt, then 2 tokens of tool output after its reply.
    assert per_call == [3, 2] and on_step_page == sum(per_call)
    page.close()
