"""Bounded output keeps the head and the tail, marks what it dropped, and holds no more
than its bound however much goes through it."""

import random
import tracemalloc

import pytest

from undertow.sandboxes.output import BoundedOutput


def test_short_output_is_kept_whole():
    output = BoundedOutput(100)
    for chunk in (b"hello ", b"world"):
        output.add(chunk)
    assert output.text() == "hello world" and not output.truncated


def test_long_output_keeps_head_and_tail_with_marker():
    output = BoundedOutput(20)
    for index in range(100):
        output.add(f"{index:03d}\n".encode())
    text = output.text()
    assert text.startswith("000\n001\n00")
    assert text.endswith("098\n099\n")
    assert output.num_dropped_bytes == 400 - 20
    assert "[... 380 bytes of output truncated ...]" in text


def test_random_chunks_keep_exactly_the_first_and_last_bytes_within_the_bound():
    rng = random.Random(0)
    stream = bytes(rng.randrange(256) for _ in range(200_000))
    output = BoundedOutput(1001)
    position = 0
    while position < len(stream):
        size = rng.choice([0, 1, 7, 300, 499, 500, 501, 4000, 30_000])
        output.add(stream[position:position + size])
        position += size
        assert len(output.head) + len(output.tail) <= 1001
        assert output.num_bytes == min(position, len(stream))
    assert bytes(output.head) == stream[:500]
    assert bytes(output.tail) == stream[-501:]
    assert output.num_dropped_bytes == len(stream) - 1001


def test_a_chunk_larger_than_the_bound_is_not_kept_whole():
    output = BoundedOutput(64)
    output.add(b"a" * 10 + b"b" * 10_000 + b"c" * 32)
    assert bytes(output.head) == b"a" * 10 + b"b" * 22
    assert bytes(output.tail) == b"c" * 32
    assert output.num_dropped_bytes == 10_042 - 64


def test_hours_of_output_cost_only_the_bound():
    """256 MiB through a 1 MiB buffer in 64 KiB chunks: the memory it allocates
    (traced) stays within twice the bound (a bytearray reserves room as it grows),
    not the stream's size."""
    chunk = bytes(range(256)) * 256                               # 64 KiB
    output = BoundedOutput(2**20)
    tracemalloc.start()
    try:
        for _ in range(4096):
            output.add(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert output.num_bytes == 2**28
    assert len(output.head) + len(output.tail) == 2**20
    assert peak < 2 * 2**20


def test_text_does_not_split_characters_at_the_cut():
    output = BoundedOutput(10)        # head 5 bytes: "é", "é", half an "é"; tail 5: 2/3 "∑", "∑"
    output.add("ééééé".encode() + b"x" * 100 + "∑∑".encode())
    assert output.text() == "éé\n[... 106 bytes of output truncated ...]\n∑"


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        BoundedOutput(-1)
