"""An engine that dies during a weight update does not end the run (issue 36 item 3).

The built-in engine that `embedded_gateway` launched for `undertow train` is killed with
SIGKILL while it holds the update request: `engine_keeper.KeptEngine` starts it again on
its port, the pool takes it back, and the learner's push (`GatewayLink.update_weights`)
waits for it and gives it the new weights; the engine itself then reports them. Engines
the user started (faithful SGLang fakes, one with `die_on_update`) are not restarted by
Undertow: the dead one is drained and removed with a warning, and the push goes on with
the other, which serves the new weights. A rollout cell's engine (`cells.GatewayEngineSlots`)
killed during the pool run's push comes back the same way."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import time
import urllib.parse
from pathlib import Path

import psutil
import pytest

from tests.engines.sglang_faithful import FaithfulSGLang, serve_faithful
from undertow.cells.pool import GatewayEngineSlots, engineless_gateway
from undertow.gateway.engines.sglang import SGLangDriver
from undertow.learner.gateway_link import EngineDropped, GatewayLink, GatewayLinkError
from undertow.run.embedded import embedded_gateway, held_on
from undertow.run.rollout_source import background_loop

TCP_ESTABLISHED = "01"


def listening_pid(url: str) -> int:
    port = urllib.parse.urlsplit(url).port
    [pid] = {c.pid for c in psutil.net_connections(kind="tcp")
             if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN}
    return pid


def has_unread_request(port: int) -> bool:
    """Whether a connection to `port` holds bytes its (stopped) server has not read."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].split(":")[1], 16)
        rx_queue = int(fields[4].split(":")[1], 16)
        if local_port == port and fields[3] == TCP_ESTABLISHED and rx_queue > 0:
            return True
    return False


def model_info(loop, url: str):
    async def ask():
        driver = SGLangDriver(url)
        try:
            return await driver.model_info()
        finally:
            await driver.close()
    return asyncio.run_coroutine_threadsafe(ask(), loop).result()


def test_the_launched_engine_killed_during_an_update_restarts_with_the_new_weights(
        tiny_model_dir, other_tiny_model_dir, tmp_path):
    (tmp_path / "run").mkdir()
    with background_loop() as loop, held_on(loop, embedded_gateway(
            tiny_model_dir, tmp_path / "run" / "store")) as gateway:
        [url] = gateway.engine_urls
        assert gateway.launched_urls == (url,)
        link = GatewayLink(gateway.url, gateway.admin_token,
                           launched_urls=gateway.launched_urls, restart_timeout_s=300)
        pid, result = kill_during_push(url, lambda: link.update_weights(other_tiny_model_dir, 1))
        [engine] = link.engines()
        info = model_info(loop, url)
        new_pid = listening_pid(url)
    assert result["weight_version"] == "1" and result["updated"] == [engine["id"]]
    assert engine["url"] == url and engine["state"] == "healthy"
    assert engine["weight_version"] == "1" and new_pid != pid
    assert info.weight_version == "1"   # the restarted engine's own word
    assert (tmp_path / "run" / "engine-restart-1.log").exists()
    with contextlib.suppress(ProcessLookupError):   # the keeper stopped it with the run
        os.kill(new_pid, 0)
        pytest.fail(f"engine {new_pid} outlived the run")


def test_a_users_engine_that_dies_during_an_update_is_dropped_and_the_run_goes_on(
        tiny_model_dir, other_tiny_model_dir, tmp_path):
    servers = [FaithfulSGLang(model_path=str(tiny_model_dir), vocab_size=8192),
               FaithfulSGLang(model_path=str(tiny_model_dir), vocab_size=8192,
                              die_on_update=True)]
    with background_loop() as loop, held_on(loop, serve_faithful(servers[0])) as url_0, \
            held_on(loop, serve_faithful(servers[1])) as url_1, held_on(
                loop, embedded_gateway(tiny_model_dir, tmp_path / "store",
                                       (url_0, url_1))) as gateway:
        assert gateway.launched_urls == ()
        link = GatewayLink(gateway.url, gateway.admin_token,
                           launched_urls=gateway.launched_urls)
        with pytest.warns(EngineDropped, match=rf"engine e1 at {url_1} died loading .* "
                          "started outside Undertow, so it is drained and removed"):
            result = link.update_weights(other_tiny_model_dir, 1)
        engines = link.engines()
    assert result["dead"] == ["e1"] and result["updated"] == ["e0"]
    assert [(e["id"], e["state"], e["weight_version"]) for e in engines] == [
        ("e0", "healthy", "1")]
    assert servers[1].dead and servers[0].weights == str(other_tiny_model_dir)


def test_a_push_that_leaves_no_engine_serving_stops_the_run_by_name(
        tiny_model_dir, other_tiny_model_dir, tmp_path):
    server = FaithfulSGLang(model_path=str(tiny_model_dir), vocab_size=8192,
                            die_on_update=True)
    with background_loop() as loop, held_on(loop, serve_faithful(server)) as url, held_on(
            loop, embedded_gateway(tiny_model_dir, tmp_path / "store", (url,))) as gateway:
        link = GatewayLink(gateway.url, gateway.admin_token)
        with pytest.warns(EngineDropped), pytest.raises(
                GatewayLinkError, match=r"no engine serves after the push .* every engine "
                "died loading it"):
            link.update_weights(other_tiny_model_dir, 1)


def kill_during_push(url: str, push) -> tuple[int, dict]:
    """SIGSTOPs the engine at `url`, runs `push()` in a thread, SIGKILLs the engine once
    the push's request waits unread on its port; returns its PID and the push's result."""
    pid = listening_pid(url)
    os.kill(pid, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pushed = pool.submit(push)
        while not has_unread_request(urllib.parse.urlsplit(url).port):
            assert not pushed.done(), pushed.result()
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        return pid, pushed.result(timeout=600)


def test_a_cells_engine_killed_during_a_push_restarts_with_the_new_weights(
        tiny_model_dir, other_tiny_model_dir, tmp_path):
    with background_loop() as loop, engineless_gateway(
            loop, tiny_model_dir, tmp_path / "store") as gateway:   # the pool run's
        link = GatewayLink(gateway.url, gateway.admin_token, restart_timeout_s=300)
        slots = GatewayEngineSlots(loop, link, tiny_model_dir, tmp_path / "engines")
        try:
            slots.start_all([0])
            engine, engine_id = slots.engines[0]
            pid, _ = kill_during_push(engine.url, lambda: slots.push(other_tiny_model_dir, 1))
            [record] = link.engines()
            info = model_info(loop, engine.url)
            new_pid = listening_pid(engine.url)
        finally:
            slots.close()
    assert (record["id"], record["state"], record["weight_version"]) == (
        engine_id, "healthy", "1")
    assert info.weight_version == "1" and new_pid != pid and slots.engines == {}
    assert sorted(p.name for p in (tmp_path / "engines").iterdir()) == [
        "cell-0-1-restart-1.log", "cell-0-1.log"]
