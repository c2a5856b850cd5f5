"""Held lines (`held_lines.py`): written oldest first, stopping at the first the disk
refuses; bounded in bytes; dropped with every owner told. The store around them, on a
real full disk: tests/gateway/test_store.py."""

import pytest

from undertow.gateway.front.held_lines import HeldLines
from undertow.gateway.metrics import GatewayMetrics


class Disk:
    """A file that takes `room` more writes, then refuses with ENOSPC."""

    def __init__(self, room: int):
        self.room, self.lines = room, []

    def write(self, data: bytes) -> None:
        if self.room == 0:
            raise OSError(28, "No space left on device")
        self.room -= 1
        self.lines.append(data)


def test_held_lines_are_written_oldest_first_and_stop_at_the_first_refused():
    held = HeldLines(max_bytes=100, max_s=60, metrics=GatewayMetrics.create())
    for index in range(3):
        assert held.hold("g", b"line %d\n" % index, lambda reason: None)
    disk = Disk(room=2)
    with pytest.raises(OSError):
        held.write_in_order("g", disk.write)
    assert disk.lines == [b"line 0\n", b"line 1\n"] and held.has("g")
    assert held.num_bytes == len(b"line 2\n")
    disk.room = 5
    held.write_in_order("g", disk.write)
    assert disk.lines[-1] == b"line 2\n" and not held.has("g") and held.num_bytes == 0


def test_the_hold_is_bounded_in_bytes_and_a_drop_tells_every_owner():
    metrics = GatewayMetrics.create()
    held, told = HeldLines(max_bytes=10, max_s=60, metrics=metrics), []
    assert held.hold("g", b"12345\n", told.append)
    assert not held.hold("g", b"123456\n", told.append)   # 6 + 7 > 10: not held
    assert held.hold("g", b"123\n", told.append)
    held.drop("g", "the disk refused them for 61 s", "past store_hold_max_s")
    assert told == ["store: a streamed call's record dropped (past store_hold_max_s)"] * 2
    assert held.groups() == [] and held.num_bytes == 0
    page = metrics.registry.render()
    assert "undertow_store_dropped_lines_total 2" in page
    assert "undertow_store_held_bytes 0" in page
    with pytest.raises(ValueError, match="store_hold_max_bytes"):
        HeldLines(max_bytes=-1, max_s=1, metrics=metrics)
