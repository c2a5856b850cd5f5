"""The gateway's one exception tree (`gateway/errors.py`) at its seams: pool and engine
errors become the API errors a scaffold gets in one place (`calls.api_error_of`, by
`isinstance`), every error carries the status the gateway would answer with, and KV
transfer is a capability every engine driver declares (`EngineDriver.supports_kv_transfer`)."""

import asyncio
import socket
from pathlib import Path

import pytest

from undertow.gateway.engines.http1 import HttpError
from undertow.gateway.engines.protocol import (
    EngineError,
    EngineRejected,
    EngineUnavailable,
    WeightsNotUpdated,
)
from undertow.gateway.engines.sglang import SGLangDriver
from undertow.gateway.engines.vllm import VLLMDriver
from undertow.gateway.errors import (
    BadRequest,
    Busy,
    GatewayError,
    PoolBusy,
    PoolError,
    PoolUnavailable,
    Unavailable,
    UnknownEngine,
)
from undertow.gateway.front.calls import api_error_of
from undertow.gateway.front.store import StoreDamaged
from undertow.gateway.trees.tree import TreeError


def test_pool_errors_become_the_api_errors_a_scaffold_gets():
    busy = api_error_of(PoolBusy(2.5))
    assert type(busy) is Busy and (busy.status, busy.retry_after_s) == (429, 2.5)
    assert "admission limit" in busy.message
    gone = api_error_of(PoolUnavailable("no healthy engine"))
    assert type(gone) is Unavailable and (gone.status, gone.message) == (503,
                                                                        "no healthy engine")


def test_an_engine_refusal_and_its_subclasses_become_a_bad_request():
    for refusal in (EngineRejected("prompt too long", status=400, url="http://e"),
                    WeightsNotUpdated("no such path", loaded=False, weight_version=None)):
        error = api_error_of(refusal)
        assert type(error) is BadRequest and error.status == 400
        assert refusal.message in error.message


def test_other_errors_pass_unchanged():
    for error in (EngineUnavailable("reset"), RuntimeError("bug"), BadRequest("x")):
        assert api_error_of(error) is error


def test_one_root_and_the_status_each_would_answer_with():
    assert EngineRejected("refused").status == 502       # no status from the engine
    assert EngineRejected("gone", status=404, url="http://e").status == 404
    assert "(404 from http://e): gone" in str(EngineRejected("gone", status=404,
                                                            url="http://e"))
    assert (PoolBusy(1.0).status, PoolUnavailable("x").status, UnknownEngine("e").status) == (
        429, 503, 404)
    for error in (EngineUnavailable("x"), HttpError("x"), PoolBusy(1.0),
                  StoreDamaged(Path("store/g.jsonl"), 3, "torn")):
        assert isinstance(error, GatewayError) and isinstance(error.status, int)
    assert isinstance(UnknownEngine("e"), PoolError | KeyError)
    assert isinstance(HttpError("x"), EngineError)
    assert not isinstance(TreeError("x"), GatewayError)
    assert isinstance(TreeError("x"), ValueError) and isinstance(
        StoreDamaged(Path("store/g.jsonl"), 1, "r"), ValueError)


def _closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize("driver", [SGLangDriver, VLLMDriver])
def test_kv_transfer_is_a_declared_capability_false_where_the_engine_lacks_it(driver):
    async def ask() -> bool:
        async with driver(_closed_port_url()) as engine:
            return await engine.supports_kv_transfer()

    assert asyncio.run(ask()) is False   # never raises, even with no engine there


async def test_a_5xx_error_is_logged_with_its_trace_and_a_4xx_is_not(caplog):
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from undertow.gateway.front.api.errors import error_middleware

    async def engine_down(request):
        raise EngineUnavailable("engine http://10.0.0.9:30000 is unreachable")

    async def bad_json(request):
        raise BadRequest("the body is not JSON")

    app = web.Application(middlewares=[error_middleware])
    app.router.add_post("/v1/chat/completions", engine_down)
    app.router.add_post("/v1/messages", bad_json)
    async with TestClient(TestServer(app)) as client:
        with caplog.at_level("ERROR", logger="undertow.gateway.front.api.errors"):
            down = await client.post("/v1/chat/completions", json={})
            refused = await client.post("/v1/messages", json={})
            body = await down.json()
    assert (down.status, refused.status) == (EngineUnavailable.status, 400)
    assert "unreachable" in body["error"]["message"]
    [record] = caplog.records
    assert "POST /v1/chat/completions failed" in record.getMessage()
    assert record.exc_info and record.exc_info[0] is EngineUnavailable
