"""Bounded capture of a command's output: the head and the tail, with a marker between."""

from collections import deque


class BoundedOutput:
    """Keeps at most `max_bytes` of a stream: the first half and the last half.

    Invariant: `len(head) + sum(len(tail)) <= max_bytes`; `num_dropped_bytes` counts
    what fell between them, and `text()` marks the gap so that no reader mistakes
    a truncated log for a whole one.
    """

    def __init__(self, max_bytes: int):
        self.max_head_bytes = max_bytes // 2
        self.max_tail_bytes = max_bytes - self.max_head_bytes
        self.head = bytearray()
        self.tail: deque[bytes] = deque()
        self.num_tail_bytes = 0
        self.num_dropped_bytes = 0

    def add(self, chunk: bytes) -> None:
        room = self.max_head_bytes - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if not chunk:
            return
        self.tail.append(chunk)
        self.num_tail_bytes += len(chunk)
        while self.num_tail_bytes > self.max_tail_bytes:
            excess = self.num_tail_bytes - self.max_tail_bytes
            first = self.tail[0]
            if len(first) <= excess:
                self.tail.popleft()
                self.num_tail_bytes -= len(first)
                self.num_dropped_bytes += len(first)
            else:
                self.tail[0] = first[excess:]
                self.num_tail_bytes -= excess
                self.num_dropped_bytes += excess

    @property
    def truncated(self) -> bool:
        return self.num_dropped_bytes > 0

    def text(self) -> str:
        middle = (f"\n[... {self.num_dropped_bytes} bytes of output truncated ...]\n".encode()
                  if self.truncated else b"")
        return (bytes(self.head) + middle + b"".join(self.tail)).decode("utf-8", errors="replace")
