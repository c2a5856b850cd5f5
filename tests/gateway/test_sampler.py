"""`sampler.choice_request`: a choice's engine request, built whole in one place, and the
`CallRequest` it starts from, whose `parses_tools` is worked out when it is built."""

from __future__ import annotations

import dataclasses

from tests.gateway.test_forced_tool_calls import TOOLS
from undertow.gateway.engines.protocol import SamplingParams, TokenIdsJson
from undertow.gateway.front.call_types import CallRequest
from undertow.gateway.front.sampler import choice_request
from undertow.gateway.front.tokentruth import Prompt
from undertow.gateway.front.toolparsers import (
    PARSERS,
    create_parser,
    forced_structural_tag,
    reasoning_first,
)

PROMPT_IDS = [3, 1, 4, 1, 5]


def forced_call(seed: int | None) -> CallRequest:
    tag = forced_structural_tag(PARSERS["glm45"], TOOLS, None)
    return CallRequest(api="chat", model="m", messages=[{"role": "user", "content": "go"}],
                       tools=TOOLS, sampling=SamplingParams(max_new_tokens=None, stop=("x",),
                                                            sampling_seed=seed,
                                                            structural_tag=tag))


def prompt() -> Prompt:
    return Prompt(PROMPT_IDS, None, None, 0, (), "", messages=[],
                  token_ids_json=TokenIdsJson.of(PROMPT_IDS))


def test_a_choices_engine_request_has_its_seed_bound_and_reasoning_first_tag():
    call, given = forced_call(seed=40), prompt()
    parser = create_parser("glm45", tools=TOOLS, prompt_tail="<|assistant|><think>")
    request = choice_request(call, given, parser, 2, "call-0123456789abcdef", 64)
    assert request.rid == "call-0123456789abcdef" and request.return_logprob
    assert request.input_ids is given.token_ids
    assert request.input_ids_json is given.token_ids_json
    tag = reasoning_first(call.sampling.structural_tag, parser)
    assert tag != call.sampling.structural_tag  # the prompt opened a think block
    assert request.sampling_params == call.sampling.evolve(max_new_tokens=64,
                                                           sampling_seed=42, structural_tag=tag)


def test_without_a_parser_the_calls_parameters_go_with_the_choices_seed_and_bound():
    call = forced_call(seed=None)
    request = choice_request(call, prompt(), None, 0, "call-0", 8)
    params = request.sampling_params
    assert params.sampling_seed is not None  # picked here, so that it is recorded
    assert params == call.sampling.evolve(max_new_tokens=8, sampling_seed=params.sampling_seed)


def test_parses_tools_is_worked_out_when_the_call_is_built():
    call = forced_call(seed=None)
    assert call.parses_tools
    assert not dataclasses.replace(call, parse_tools=False).parses_tools
    assert not dataclasses.replace(call, tools=None).parses_tools
