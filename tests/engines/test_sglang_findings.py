"""What a real SGLang 0.5.23 server showed under the gateway (issue 36), one test each,
against `sglang_faithful.FaithfulSGLang` (its docstring, items 1 and 10, names SGLang's
code): seeds that replay nothing without deterministic inference, an out-of-vocabulary
prompt ID or an unloadable checkpoint that kills the server, and engines of different
weight versions in one pool.

Each test fails on the gateway as it was before the fix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path

import aiohttp
import numpy as np
import openai
import pytest
from safetensors.numpy import load_file, save_file

from tests.engines.sglang_faithful import FaithfulSGLang, serve_faithful
from tests.gateway.capture import captured
from tests.gateway.conftest import ADMIN_TOKEN, start_gateway
from undertow.gateway.engine_pool.fleet import WeightVersionConflict
from undertow.gateway.engine_pool.pool import EnginePool, PoolConfig
from undertow.gateway.engines.protocol import (
    EngineUnavailable,
    GenerateRequest,
    SamplingParams,
)
from undertow.gateway.engines.sglang import SGLangDriver
from undertow.gateway.front.app import POOL_KEY, STORE_KEY

pytestmark = pytest.mark.asyncio(loop_scope="session")

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROMPT = (11, 12, 13, 14, 15, 16)
MESSAGES = [{"role": "user", "content": "Fix the failing test."}]
SMALLER_VOCAB = 8000  # rows of the embedding of `small_embedding_dir`, whose tokenizer has 8192


@contextlib.asynccontextmanager
async def gateway_on(urls: list[str], model_dir: Path, store_dir: Path):
    """A gateway on `model_dir` in front of `urls`; yields (app, url, http session)."""
    app, runner, url = await start_gateway(urls, model_dir, store_dir)
    try:
        async with aiohttp.ClientSession() as http:
            yield app, url, http
    finally:
        await runner.cleanup()


async def open_session(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.post(f"{url}/admin/sessions", json={"group": "g"}, headers=ADMIN) as reply:
        assert reply.status == 201, await reply.text()
        return await reply.json()


@pytest.fixture(scope="module")
def small_embedding_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model as a model whose embedding holds fewer IDs than its tokenizer: its
    `config.json` says vocab_size 8000 (the tokenizer has 8192 tokens)."""
    model_dir = tmp_path_factory.mktemp("models") / "small-embedding"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": SMALLER_VOCAB}))
    return model_dir


# 1 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("deterministic", [False, True], ids=["plain", "deterministic"])
async def test_whether_seeds_replay_is_said_once_and_recorded_with_each_call(
        deterministic, tiny_model_dir, tmp_path, caplog):
    """Without `--enable-deterministic-inference` SGLang ignores `sampling_seed`: the driver
    reads that from `/server_info`, says it once, and each call's record says it."""
    server = FaithfulSGLang(vocab_size=8186, deterministic=deterministic)
    caplog.set_level(logging.INFO, logger="undertow.gateway.engines.sglang")
    async with (serve_faithful(server) as engine_url,
                gateway_on([engine_url], tiny_model_dir, tmp_path) as (app, url, http)):
        for _ in range(2):
            session = await open_session(http, url)
            async with http.post(f"{session['base_url']}/chat/completions", json={
                    "model": "m", "messages": MESSAGES, "max_tokens": 8},
                    headers={"Authorization": f"Bearer {session['api_key']}"}) as reply:
                assert reply.status == 200, await reply.text()
        async with http.get(f"{url}/admin/engines", headers=ADMIN) as reply:
            engines = (await reply.json())["engines"]
        calls = app[STORE_KEY].tree("g").calls
        async with SGLangDriver(engine_url) as driver:  # the first call, replayed by its seed
            sent = server.bodies["/generate"][0]
            replayed = await driver.generate(GenerateRequest(
                input_ids=tuple(sent["input_ids"]), sampling_params=SamplingParams(
                    max_new_tokens=8, sampling_seed=sent["sampling_params"]["sampling_seed"])))
    assert [call.meta["honours_seeds"] for call in calls] == [deterministic] * 2
    assert engines[0]["honours_seeds"] is deterministic
    said = [record for record in caplog.records if engine_url in record.getMessage()]
    assert len(said) == 1
    assert (said[0].levelno, "replay nothing" in said[0].getMessage()) == (
        (logging.INFO, False) if deterministic else (logging.WARNING, True))
    recorded = captured(app[STORE_KEY].tree("g"), calls[0].call_id).completion_ids
    assert (list(replayed.output_ids) == list(recorded)) is deterministic


# 2 -------------------------------------------------------------------------------------

async def test_an_out_of_vocabulary_prompt_id_takes_sglang_down():
    """The faithful server as SGLang 0.5.23: no reply, and nothing answers afterwards."""
    server = FaithfulSGLang(vocab_size=8192)
    async with serve_faithful(server) as url, SGLangDriver(url) as driver:
        assert await driver.health()
        with pytest.raises(EngineUnavailable):
            await driver.generate(GenerateRequest(input_ids=(*PROMPT, 8197)))
        assert not await driver.health()
    assert server.dead


async def test_the_gateway_refuses_a_prompt_id_the_model_cannot_embed(small_embedding_dir,
                                                                      tmp_path):
    """An ID the tokenizer has but the embedding does not (8100 of 8192 tokens, 8000 rows)
    is refused with a 400 before any engine sees it; the engine keeps serving."""
    server = FaithfulSGLang(vocab_size=SMALLER_VOCAB)
    async with (serve_faithful(server) as engine_url,
                gateway_on([engine_url], small_embedding_dir, tmp_path) as (_, url, http)):
        session = await open_session(http, url)
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"],
                                    max_retries=0)
        try:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(model="m", prompt=[*PROMPT, 8100], max_tokens=4)
            served = await client.completions.create(model="m", prompt=[*PROMPT, 7999],
                                                     max_tokens=4)
        finally:
            await client.close()
    assert "[0, 8000)" in refused.value.message
    assert [body["input_ids"] for body in server.bodies["/generate"]] == [[*PROMPT, 7999]]
    assert not server.dead and served.choices[0].finish_reason == "length"


async def test_a_chat_prompt_rendered_to_an_id_the_model_cannot_embed_is_refused(
        small_embedding_dir, tmp_path):
    """The tokenizer writes " failing" as ID 8185, which an 8000-row embedding lacks: the
    rendered prompt is refused (400, naming it) and never sent; other text is served."""
    server = FaithfulSGLang(vocab_size=SMALLER_VOCAB)
    async with (serve_faithful(server) as engine_url,
                gateway_on([engine_url], small_embedding_dir, tmp_path) as (_, url, http)):
        session = await open_session(http, url)
        replies = []
        for content in ("Fix the failing test.", "Fix the test."):
            async with http.post(f"{session['base_url']}/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": content}],
                    "max_tokens": 4},
                    headers={"Authorization": f"Bearer {session['api_key']}"}) as reply:
                replies.append((reply.status, await reply.json()))
    (refused_status, refused), (served_status, _) = replies
    assert refused_status == 400 and "token ID 8185 ('Ġfailing')" in refused["error"]["message"]
    assert served_status == 200 and len(server.bodies["/generate"]) == 1 and not server.dead


# 6a ------------------------------------------------------------------------------------

async def test_engines_of_different_weight_versions_are_refused_at_start(tiny_model_dir,
                                                                         tmp_path):
    """Before any update the pool cannot align them, so it refuses the second: at start
    (the pool does not start) and when an operator adds it (400, naming both)."""
    first, second = FaithfulSGLang(weight_version="0"), FaithfulSGLang(weight_version="7")
    async with serve_faithful(first) as url_0, serve_faithful(second) as url_7:
        pool = EnginePool([url_0, url_7], PoolConfig(health_timeout_s=5.0))
        try:
            with pytest.raises(WeightVersionConflict, match=r"'7'.*e0.*'0'"):
                await pool.start()
        finally:
            await pool.close()
        async with gateway_on([url_0], tiny_model_dir, tmp_path) as (app, url, http):
            async with http.post(f"{url}/admin/engines", json={"url": url_7},
                                 headers=ADMIN) as reply:
                refused = (reply.status, (await reply.json())["error"]["message"])
            await app[POOL_KEY].update_weights("/models/b", 3)
            async with http.post(f"{url}/admin/engines", json={"url": url_7},
                                 headers=ADMIN) as reply:
                added = (reply.status, (await reply.json())["weight_version"])
    assert refused[0] == 400 and "mix weights" in refused[1]
    assert added == (201, "3")  # after a push, a joining engine is given the pool's weights
    assert second.model_path == "/models/b"


# 3 -------------------------------------------------------------------------------------

def _checkpoint_variant(source: Path, out: Path, change: str) -> Path:
    """A copy of the model `source` that SGLang could not load into it: another vocabulary
    or architecture in `config.json`, or one tensor of another shape."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    if change == "vocabulary":
        config["vocab_size"] = 8000
    elif change == "architecture":
        config["architectures"] = ["LlamaForCausalLM"]
    else:
        tensors = load_file(out / "model.safetensors")
        name = "model.layers.0.mlp.down_proj.weight"
        tensors[name] = np.ascontiguousarray(tensors[name][:, :512])
        save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("change, named", [
    ("vocabulary", "vocab_size is 8000, the served model's 8192"),
    ("architecture", "architectures is ['LlamaForCausalLM'], the served model's "
                     "['Qwen3ForCausalLM']"),
    ("shape", "shapes differ: model.layers.0.mlp.down_proj.weight [256, 512] (served: "
              "[256, 768])"),
])
async def test_a_checkpoint_the_engines_cannot_load_is_refused_before_any_gets_it(
        change, named, tiny_model_dir, tmp_path):
    checkpoint = _checkpoint_variant(tiny_model_dir, tmp_path / "checkpoint", change)
    server = FaithfulSGLang(model_path=str(tiny_model_dir), vocab_size=8192)
    async with (serve_faithful(server) as engine_url,
                gateway_on([engine_url], tiny_model_dir, tmp_path / "store") as (_, url, http)):
        async with http.post(f"{url}/admin/update_weights", headers=ADMIN, json={
                "model_path": str(checkpoint), "weight_version": 1}) as reply:
            status, message = reply.status, (await reply.json())["error"]["message"]
        async with http.get(f"{url}/admin/engines", headers=ADMIN) as reply:
            listed = await reply.json()
    assert status == 400 and named in message, message
    assert "/update_weights_from_disk" not in server.bodies and not server.dead
    assert not listed["paused"] and listed["engines"][0]["state"] == "healthy"


async def test_an_engine_that_dies_loading_weights_is_dead_not_stale(tiny_model_dir,
                                                                    other_tiny_model_dir):
    """A load that passes the check but kills one engine: that engine is dead (probed until
    it answers, then given the pool's weights), the other serves the new weights."""
    servers = [FaithfulSGLang(model_path=str(tiny_model_dir), vocab_size=8192),
               FaithfulSGLang(model_path=str(tiny_model_dir), vocab_size=8192,
                              die_on_update=True)]
    async with (serve_faithful(servers[0]) as url_0, serve_faithful(servers[1]) as url_1):
        pool = EnginePool([url_0, url_1], PoolConfig(health_timeout_s=5.0))
        await pool.start()
        try:
            outcome = await pool.update_weights(str(other_tiny_model_dir), 1)
            states = {engine.engine_id: str(engine.state) for engine in pool.engines}
            versions = [engine.weight_version for engine in pool.engines]
        finally:
            await pool.close()
    assert (list(outcome["failed"]), outcome["dead"], outcome["updated"]) == (
        ["e1"], ["e1"], ["e0"])
    assert states == {"e0": "healthy", "e1": "dead"} and versions == ["1", None]
    assert outcome["pool_weights"] == {"model_path": str(other_tiny_model_dir),
                                       "weight_version": "1"}
    assert servers[1].dead and servers[0].weights == str(other_tiny_model_dir)
