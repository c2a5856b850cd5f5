"""`InFlight`'s engine requests: the first attempt sends the caller's request as it is, and
a resume derives its own (`resumed_request`), against a scripted engine that remembers
what it was sent."""

from __future__ import annotations

import pytest

from tests.engine_pool.test_pool import PROMPT, collect, scripted_pool, tokens_of
from tests.gateway.scripted_engine import ScriptedEngine
from undertow.gateway.engine_pool.inflight import resume_rid, resume_seed, resumed_request
from undertow.gateway.engines.protocol import GenerateRequest, SamplingParams, TokenIdsJson


def request_of(max_new_tokens: int | None = 20, seed: int | None = 5) -> GenerateRequest:
    return GenerateRequest(input_ids=PROMPT, rid="call-0", return_logprob=True,
                           input_ids_json=TokenIdsJson.of(PROMPT),
                           sampling_params=SamplingParams(max_new_tokens=max_new_tokens,
                                                          temperature=0.5,
                                                          sampling_seed=seed))


def test_a_resume_after_tokens_has_the_longer_input_its_own_id_seed_and_bound():
    request = request_of()
    resumed = resumed_request(request, [11, 12, 13], 2)
    assert list(resumed.input_ids or ()) == [*PROMPT, 11, 12, 13]
    assert resumed.input_ids_json is None  # the caller's array was of the prompt alone
    assert resumed.rid == resume_rid("call-0", 2)
    assert resumed.sampling_params == request.sampling_params.evolve(
        max_new_tokens=17, sampling_seed=resume_seed(5, 2))
    assert resumed.return_logprob


def test_a_resume_before_any_token_keeps_the_input_and_its_json():
    request = request_of(max_new_tokens=None, seed=None)
    resumed = resumed_request(request, [], 1)
    assert resumed.input_ids is request.input_ids
    assert resumed.input_ids_json is request.input_ids_json
    assert resumed.rid == resume_rid("call-0", 1)
    assert resumed.sampling_params.max_new_tokens is None
    assert resumed.sampling_params.sampling_seed is None  # the driver draws one


@pytest.mark.asyncio(loop_scope="session")
async def test_the_first_attempt_sends_the_request_as_given_and_a_resume_its_own():
    script = list(range(11, 31))
    engine = ScriptedEngine(default=script, delay_s=0.02)
    request = request_of()
    async with scripted_pool(engine) as pool:
        stream = pool.generate("s1", request)
        chunks = [await anext(stream)]
        await pool.pause("abort_resume")
        await pool.resume()
        chunks += await collect(stream)
    first, resumed = engine.sent["call-0"], engine.sent[resume_rid("call-0", 1)]
    assert first.input_ids == PROMPT
    assert first.sampling_params["sampling_seed"] == 5
    assert first.sampling_params["max_new_tokens"] == 20
    produced = resumed.input_ids[len(PROMPT):]
    assert 0 < len(produced) < 20 and produced == script[:len(produced)]
    assert resumed.input_ids == PROMPT + produced
    assert resumed.sampling_params["sampling_seed"] == resume_seed(5, 1)
    assert resumed.sampling_params["max_new_tokens"] == 20 - len(produced)
    assert tokens_of(chunks) == produced + resumed.output_ids
