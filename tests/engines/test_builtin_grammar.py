"""Structured output on the built-in engine (SGLang's `json_schema`, `regex` and `ebnf`
sampling parameters, enforced with xgrammar). The tiny model's weights are random, so
its free output is never JSON (checked first, with the same prompts and seeds): only a
working constraint can make it obey the schema."""

import json
import re

import aiohttp

from tests.engines.builtin_client import generate, post, prompt, stream

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["path", "line", "kind", "ok"],
          "properties": {"path": {"type": "string", "maxLength": 6},
                         "line": {"type": "integer", "minimum": 0, "maximum": 99},
                         "kind": {"enum": ["read", "edit"]},
                         "ok": {"type": "boolean"}}}
SEEDS = (1, 2, 3, 4)


def obeys(value) -> bool:
    """Whether `value` matches SCHEMA (checked by hand, every keyword)."""
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"])
            and isinstance(value["path"], str) and len(value["path"]) <= 6
            and isinstance(value["line"], int) and not isinstance(value["line"], bool)
            and 0 <= value["line"] <= 99 and value["kind"] in ("read", "edit")
            and isinstance(value["ok"], bool))


def parsed(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def params(seed: int, **constraint) -> dict:
    return {"max_new_tokens": 64, "temperature": 1.0, "sampling_seed": seed, **constraint}


async def test_free_output_of_the_random_model_is_not_json(builtin_engine_url):
    async with aiohttp.ClientSession() as session:
        for seed in SEEDS:
            reply = await generate(session, builtin_engine_url, input_ids=prompt(seed, 12),
                                   sampling_params=params(seed))
            assert not obeys(parsed(reply["text"]))


async def test_json_schema_is_obeyed_at_temperature_one(builtin_engine_url):
    schema = json.dumps(SCHEMA)
    async with aiohttp.ClientSession() as session:
        for seed in SEEDS:
            reply = await generate(session, builtin_engine_url, input_ids=prompt(seed, 12),
                                   return_logprob=True,
                                   sampling_params=params(seed, json_schema=schema))
            assert obeys(parsed(reply["text"])), reply["text"]
            meta = reply["meta_info"]
            assert meta["finish_reason"]["type"] == "stop"  # the grammar ended it with EOS
            assert all(logprob <= 0.0 for logprob, _, _ in meta["output_token_logprobs"])


async def test_regex_and_ebnf_are_obeyed_streaming_too(builtin_engine_url):
    async with aiohttp.ClientSession() as session:
        for seed in SEEDS:
            reply = await generate(session, builtin_engine_url, input_ids=prompt(seed, 9),
                                   sampling_params=params(seed, regex=r"[a-c]{3}-[0-9]{2}"))
            assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", reply["text"]), reply["text"]
            chunks = await stream(session, builtin_engine_url, input_ids=prompt(seed, 9),
                                  sampling_params=params(seed, ebnf='root ::= "yes" | "no"'))
            assert chunks[-2]["text"] in ("yes", "no")


async def test_bad_constraints_are_refused_by_name(builtin_engine_url):
    async with aiohttp.ClientSession() as session:
        for constraint, field in (({"json_schema": "{not json"}, "json_schema"),
                                  ({"regex": "[a-"}, "regex"),
                                  ({"ebnf": "root ::= "}, "ebnf"),
                                  ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one")):
            status, body = await post(session, builtin_engine_url, "/generate", {
                "input_ids": prompt(5, 4), "sampling_params": params(5, **constraint)})
            assert status == 400 and field in json.dumps(body), (constraint, body)
