"""Bounded output keeps the head and the tail and marks what it dropped."""

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
