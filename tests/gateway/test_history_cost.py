"""What a call costs the gateway as its session's history grows (issue 30, section 1).

A session that re-sends its whole history on every call must cost the gateway what the
call adds, not what came before: no step of token truth (the heads, the prompt, the
tree) may copy or read the history per call. Measured without clocks: the memory blocks
that the token-truth state holds after each call (tracemalloc; the sizes are exact and
the same on any machine). A head that kept its path as a list of its own was one block
of 8 bytes per history token, a new one every call; shared `TokenPath` chunks are as
large as what one call added.
"""

import random
import tracemalloc

import openai
import pytest

from undertow.gateway.front.token_path import TokenPath
from undertow.gateway.trees.tree import ROOT, Tree, tree_from_json, tree_to_json

NUM_CALLS = 40
NUM_WORDS = 300
# where a call's token IDs are kept between calls: heads, prompts, paths and the tree.
# (The engine request's JSON, in `engines/protocol.py`, is kept in at most 64 pieces,
# joined once every 32 calls of a session: a copy amortised over those calls.)
STATE_FILES = ("front/call_record.py", "front/calls.py", "front/sessions.py", "front/tokentruth.py",
               "front/token_path.py", "trees/tree.py")
WORDS = ["file", "test", "error", "line", "return", "value", "import", "class", "patch"]


async def traced(call, patterns=tuple(f"*/gateway/{name}" for name in STATE_FILES)
                 ) -> tuple[object, list[int]]:
    """What the awaitable `call` returns, and the sizes of the blocks it allocated in
    the files that `patterns` match (by default the token-truth state's modules) and
    left alive (traced only while it runs)."""
    tracemalloc.start()
    try:
        result = await call
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, pattern) for pattern in patterns])
    finally:
        tracemalloc.stop()
    return result, [trace.size for trace in snapshot.traces]


def observation(turn: int) -> str:
    rng = random.Random(turn)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(NUM_WORDS))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_growing_session_holds_no_block_the_size_of_its_history(gateway, scripted):
    session = await gateway.open_session("growing")
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
    messages = [{"role": "system", "content": "You are an agent."},
                {"role": "user", "content": observation(0)}]
    largest, prompt_tokens = {}, {}
    try:
        for call in range(1, NUM_CALLS + 1):
            request = client.chat.completions.create(model="m", messages=messages)
            if call in (10, NUM_CALLS):
                reply, sizes = await traced(request)
                largest[call] = max(sizes)
            else:
                reply = await request
            prompt_tokens[call] = reply.usage.prompt_tokens
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": observation(call)}]
    finally:
        await client.close()
    tree = gateway.tree("growing")
    assert all(not c.branch and c.meta["token_truth"] for c in tree.calls[1:])
    assert prompt_tokens[NUM_CALLS] > 3.5 * prompt_tokens[10]  # the history did grow
    # the largest block is about one call's new IDs, however long the history
    assert largest[NUM_CALLS] <= 1.5 * largest[10], (largest, prompt_tokens)
    assert largest[NUM_CALLS] < 8 * prompt_tokens[NUM_CALLS] / 4


def test_token_path_reads_like_the_list_it_holds():
    chunks = [[5, 6, 7], [8], [], [9, 10, 11, 12]]
    flat = [5, 6, 7, 8, 9, 10, 11, 12]
    path = TokenPath()
    for chunk in chunks:
        path = path.extend(chunk)
    assert path == flat and flat == path and list(path) == flat and len(path) == 8
    assert path.num_chunks == 3
    for index in range(-8, 8):
        assert path[index] == flat[index]
    for start in range(-9, 10):
        for stop in range(-9, 10):
            assert path[start:stop] == flat[start:stop]
    assert path[::3] == flat[::3] and path + [1] == [*flat, 1] and [0] + path == [0, *flat]
    for num in range(10):
        assert path.prefix(num) == flat[:num]
    assert path.prefix(4).num_chunks == 2 and path.prefix(3).num_chunks == 1
    with pytest.raises(IndexError):
        path[8]


def test_extending_a_path_leaves_it_and_its_source_unchanged():
    """Two calls may extend the same head: neither sees the other's IDs, and the list
    a path was made from may change afterwards without changing the path."""
    source = [1, 2, 3]
    head = TokenPath.of(source)
    source.append(99)
    first, second = head.extend([4]), head.extend([7, 8])
    assert head == [1, 2, 3] and first == [1, 2, 3, 4] and second == [1, 2, 3, 7, 8]
    assert TokenPath.of(first) is first


def test_path_lengths_are_kept_through_splits_undo_and_json():
    """`Node.path_end` (what `path_length` and `on_path` read instead of walking the
    path) equals the path's IDs counted, for every node, after splits, an undone call
    and a round trip through JSON."""
    tree = Tree("g")
    tree.add_call("a", "s", [1, 2, 3, 4, 5], [6, 7], [-0.1, -0.2], [0, 0])
    tree.add_call("b", "s", [1, 2, 3, 9], [8], [-0.3], [0])  # splits the first prompt
    tree.add_call("c", "t", [1, 2], [5], [-0.4], [0])  # splits it again
    with pytest.raises(RuntimeError), tree.transaction():
        tree.add_call("d", "s", [1, 2, 3, 4, 5, 6, 7, 1], [2], [-0.5], [0])
        raise RuntimeError("undone")
    for copy in (tree, tree_from_json(tree_to_json(tree))):
        for node_id in copy.nodes:
            assert copy.path_length(node_id) == len(copy.path_token_ids(node_id))
    leaves = {call.leaf for call in tree.calls}
    assert all(tree.on_path(node, leaf) == (node in tree.path(leaf))
               for node in tree.nodes if node != ROOT for leaf in leaves)
    assert tree.sessions["s"].leaves == [tree.calls[0].leaf, tree.calls[1].leaf]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_growing_session_parses_only_the_messages_each_call_adds(gateway, scripted):
    """A call's body is parsed where it is new (`api/resent_body.py`): the objects that
    the parse of call 40 leaves alive (the session keeps the request's messages for the
    next call) are those of its two new messages, as at call 10. Parsed whole, every
    call made (and kept) new objects for all its messages: at call 40 four times as
    many bytes of them as at call 10, the size of the history's text."""
    session = await gateway.open_session("growing-parse")
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
    messages = [{"role": "system", "content": "You are an agent."},
                {"role": "user", "content": observation(0)}]
    kept = {}
    try:
        for call in range(1, NUM_CALLS + 1):
            request = client.chat.completions.create(model="m", messages=messages)
            if call in (10, NUM_CALLS):
                reply, sizes = await traced(request, ("*/gateway/front/api/*",))
                kept[call] = sum(sizes)
            else:
                reply = await request
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": observation(call)}]
    finally:
        await client.close()
    history_bytes = sum(len(m.get("content") or "") for m in messages)
    assert history_bytes > 40 * len(observation(1))
    assert kept[NUM_CALLS] <= 1.5 * kept[10], kept
    assert kept[NUM_CALLS] < history_bytes / 8, (kept, history_bytes)
