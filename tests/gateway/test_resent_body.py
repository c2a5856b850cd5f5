"""A re-sent body is parsed and hashed where it is new (`gateway/front/api/resent_body.py`): the
result is always what parsing the whole body gives, its digest always the whole body's
XXH3, and a body that extends the previous one costs the parser and the hash its new
bytes, not its history (counted: the bytes handed to them)."""

import json
import random

import orjson
import pytest
import xxhash

from undertow.gateway.front.api.resent_body import KnownBody, parse_resent

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run [a] {command}",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]


class CountingLoads:
    """orjson.loads, counting the bytes it is handed."""

    def __init__(self):
        self.num_bytes = 0
        self.num_calls = 0

    def __call__(self, data) -> object:
        self.num_bytes += len(data)
        self.num_calls += 1
        return orjson.loads(data)


class CountingHash:
    """xxhash.xxh3_128, counting the bytes it is handed (shared by its copies)."""

    def __init__(self, state=None, counter=None):
        self.state = state or xxhash.xxh3_128()
        self.counter = counter if counter is not None else [0]

    def update(self, data) -> None:
        self.counter[0] += len(data)
        self.state.update(data)

    def copy(self) -> "CountingHash":
        return CountingHash(self.state.copy(), self.counter)

    def hexdigest(self) -> str:
        return self.state.hexdigest()


def parsed(raw: bytes, known: KnownBody | None, loads=orjson.loads, hasher=xxhash.xxh3_128):
    body, new_known = parse_resent(raw, known, whole=loads, loads=loads, hasher=hasher)
    whole = orjson.loads(raw)
    assert body == whole and list(body) == list(whole), (raw[-200:], body, whole)
    assert new_known.digest == xxhash.xxh3_128_hexdigest(raw)
    return body, new_known


def message(rng: random.Random, call: int) -> list[dict]:
    text = " ".join(rng.choice(["a", "b}]", '"q"', "], \"tools\": [", "\\n", "é", "\u2028"])
                    for _ in range(rng.randrange(1, 30)))
    return [{"role": "assistant", "content": None, "tool_calls": [{
                "id": f"c{call}", "type": "function",
                "function": {"name": "bash", "arguments": json.dumps({"command": text})}}]},
            {"role": "tool", "tool_call_id": f"c{call}", "content": text}]


def dumps(fields: list[tuple[str, object]], indent: int | None = None) -> bytes:
    """A JSON object with these fields in this order (repeated keys kept)."""
    inner = ", ".join(f"{json.dumps(k)}: {json.dumps(v, indent=indent)}" for k, v in fields)
    return ("{" + inner + "}").encode()


@pytest.mark.parametrize("layout", ["messages first", "messages last", "indented",
                                    "tail changes", "no tail"])
def test_a_growing_session_parses_as_its_whole_bodies_do(layout):
    rng = random.Random(layout)
    messages = [{"role": "system", "content": "You are an agent."},
                {"role": "user", "content": "fix the bug"}]
    known, loads = None, CountingLoads()
    for call in range(1, 25):
        fields = [("model", "m"), ("messages", messages), ("tools", TOOLS),
                  ("max_tokens", 400 - call if layout == "tail changes" else 400)]
        if layout == "messages last":
            fields = [fields[0], *fields[2:], fields[1]]
        if layout == "no tail":
            fields = fields[:2]
        raw = (dumps(fields, indent=2) if layout == "indented"
               else json.dumps(dict(fields)).encode() if layout != "messages last"
               else dumps(fields))
        num_parsed = loads.num_bytes
        _, known = parsed(raw, known, loads)
        assert known is not None and known.end is not None
        messages = messages + message(rng, call)
    assert loads.num_bytes - num_parsed < len(raw) / 4  # the last body was spliced


def test_a_chain_of_bodies_parses_and_hashes_only_what_each_adds():
    messages = [{"role": "user", "content": "x" * 1000}]
    known, loads, per_call, first = None, CountingLoads(), [], None
    hash_counter, hashed = [0], []
    for call in range(1, 31):
        raw = json.dumps({"model": "m", "messages": messages, "tools": TOOLS,
                          "stream": False}).encode()
        before, hashed_before = loads.num_bytes, hash_counter[0]
        body, known = parsed(raw, known, loads, lambda: CountingHash(counter=hash_counter))
        per_call.append(loads.num_bytes - before)
        hashed.append(hash_counter[0] - hashed_before)
        first = first or body["messages"][0]
        assert body["messages"][0] is first  # one object for the whole chain
        messages = messages + [{"role": "assistant", "content": f"call {call}"},
                               {"role": "user", "content": "y" * 500}]
    assert len(raw) > 15_000
    # call 1 is parsed whole, call 2 once more to prove where the history ends; from
    # then on a call costs the parser its ~560 new bytes, however long the body
    assert per_call[0] > 1000 and per_call[1] > 1000
    assert max(per_call[2:]) < 700, per_call
    # the hash: call 1 whole; each later one its ~560 new bytes and the ~330 after them
    assert hashed[0] > 1000 and max(hashed[1:]) < 1000 < len(raw) / 15, hashed


@pytest.mark.parametrize("change", ["earlier message", "tools", "model before messages",
                                    "not json", "number appended", "messages again"])
def test_a_body_that_does_not_extend_the_known_one_is_parsed_whole(change):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    first = json.dumps({"model": "m", "messages": messages, "tools": TOOLS}).encode()
    second = json.dumps({"model": "m", "messages": messages + [{"role": "user", "content": "2"}],
                         "tools": TOOLS}).encode()
    _, known = parsed(first, None)
    _, known = parsed(second, known)  # proves where the history ends
    extended = messages + [{"role": "user", "content": "2"}, {"role": "user", "content": "3"}]
    raw = {
        "earlier message": json.dumps({"model": "m", "messages": [
            {"role": "user", "content": "HELLO"}, *extended[1:]], "tools": TOOLS}),
        "tools": json.dumps({"model": "m", "messages": extended, "tools": TOOLS * 2}),
        "model before messages": json.dumps({"model": "other", "messages": extended}),
        "not json": second.decode()[:-1] + ', {"role": "user", "content": "3"]}',
        "number appended": second.decode().replace('"2"}]', '"2"}, 7]'),
        "messages again": second.decode()[:-1] + ', "messages": [{}]}',
    }[change].encode()
    if change == "not json":
        with pytest.raises(orjson.JSONDecodeError):
            parse_resent(raw, known)
        return
    parsed(raw, known)


def test_keys_repeated_around_the_history_parse_as_the_whole_body_does():
    messages = [{"role": "user", "content": "hello"}]
    known = None
    for call in range(4):
        fields = [("model", "first"), ("messages", messages), ("model", f"second {call}"),
                  ("stream", False)]
        if call == 3:
            fields = fields[:2]  # the repeated key is gone: the first value stands
        _, known = parsed(dumps(fields), known)
        messages = messages + [{"role": "user", "content": f"more {call}"}]


def test_an_end_that_is_not_the_history_s_is_refused_by_its_proof():
    """A key repeated after the history: the last `]` after which the fields parse as
    the body's ends the repeated `tools`, not `messages`; the proof refuses it, so a
    body that adds a tool is not read as adding a message."""
    first = b'{"tools": [{"x": 1}], "messages": [{"role": "user"}], "tools": [{"x": 1}]}'
    _, known = parsed(first, None)
    assert first[known.end:] == b"]}" and known.before is None  # not proved yet
    parsed(first.replace(b'{"x": 1}]}', b'{"x": 1}, {"role": "tool"}]}'), known)


def test_the_pieces_of_a_growing_body_are_what_it_adds():
    messages = [{"role": "user", "content": "z" * 2000}]
    known, loads = None, CountingLoads()
    for call in range(6):
        raw = json.dumps({"messages": messages, "tools": TOOLS, "max_tokens": 100 + call}
                         ).encode()
        before = loads.num_bytes
        _, known = parsed(raw, known, loads)
        messages = messages + [{"role": "user", "content": f"call {call}"}]
    # the fields after the history changed (max_tokens): found again, still not the whole
    assert loads.num_bytes - before < 1000 and len(raw) > 2400, loads.num_bytes - before
