"""Structured output on the built-in engine (SGLang's `json_schema`, `regex`, `ebnf` and
`structural_tag` sampling parameters, enforced with xgrammar). The tiny model's weights are
random, so its free output is never JSON (checked first, with the same prompts and seeds):
only a working constraint can make it obey the schema."""

import json
import re

import aiohttp

from tests.builtin_engine.wire import generate, post, prompt, stream

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
                                  ({"structural_tag": "{}"}, "structural_tag"),
                                  ({"structural_tag": json.dumps({"type": "structural_tag",
                                    "format": {"type": "nope"}})}, "structural_tag"),
                                  ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one")):
            status, body = await post(session, builtin_engine_url, "/generate", {
                "input_ids": prompt(5, 4), "sampling_params": params(5, **constraint)})
            assert status == 400 and field in json.dumps(body), (constraint, body)


CALL_BEGIN, CALL_END = '<tool_call>\n{"name": "edit", "arguments": ', "}\n</tool_call>"
CALL = re.compile(r"<tool_call>\n\{\"name\": \"edit\", \"arguments\": (.*)\}\n</tool_call>",
                  re.S)


def read_calls(text: str) -> list:
    """The arguments of each `<tool_call>` block, read by hand: the text must be blocks
    joined by newlines and nothing else."""
    blocks = text.split("\n<tool_call>")
    blocks = blocks[:1] + ["<tool_call>" + block for block in blocks[1:]]
    matches = [CALL.fullmatch(block) for block in blocks]
    return [json.loads(match.group(1), strict=False) if match else None  # xgrammar lets
            for match in matches]  # control characters into strings, as SGLang does


async def test_a_structural_tag_is_obeyed_in_xgrammars_format_and_the_legacy_one(
        builtin_engine_url):
    """SGLang 0.5.23 takes both forms (`dispatch_structural_tag`): xgrammar's own (here
    calls joined by a newline, at least one; JSON with at most one blank in a row, else
    the random model writes blanks to its budget) and the legacy structures with triggers
    and `at_least_one` (the output then begins with a tag; its JSON has no bound on blanks,
    so only its start is read)."""
    tag = {"type": "tag", "begin": CALL_BEGIN, "end": CALL_END,
           "content": {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 1}}
    current = json.dumps({"type": "structural_tag", "format": {
        "type": "tags_with_separator", "tags": [tag], "separator": "\n",
        "at_least_one": True, "stop_after_first": False}})
    legacy = json.dumps({"type": "structural_tag", "triggers": ["<tool_call>"],
                         "structures": [{"begin": CALL_BEGIN, "schema": SCHEMA,
                                         "end": CALL_END}], "at_least_one": True})
    async with aiohttp.ClientSession() as session:
        for seed in SEEDS:
            reply = await generate(session, builtin_engine_url, input_ids=prompt(seed, 12),
                                   sampling_params=params(seed, max_new_tokens=160,
                                                          structural_tag=current))
            calls = read_calls(reply["text"])
            assert calls and all(obeys(call) for call in calls), reply["text"]
            assert reply["meta_info"]["finish_reason"]["type"] == "stop"
            reply = await generate(session, builtin_engine_url, input_ids=prompt(seed, 12),
                                   sampling_params=params(seed, max_new_tokens=64,
                                                          structural_tag=legacy))
            assert reply["text"].startswith(CALL_BEGIN + "{"), reply["text"]
