"""Bounded capture of a command's output: the head and the tail, with a marker between."""


class BoundedOutput:
    """Keeps at most `max_bytes` of a stream: the first half and the last half.

    Invariant: `len(head) + len(tail) <= max_bytes`; `num_bytes` counts every byte
    added and `num_dropped_bytes` what fell between head and tail; `text()` marks the
    gap so that no reader mistakes a truncated log for a whole one. However long the
    stream runs, the head is filled once and the tail is one buffer trimmed from the front:
    a chunk larger than the tail is never stored whole.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_head_bytes = max_bytes // 2
        self.max_tail_bytes = max_bytes - self.max_head_bytes
        self.head = bytearray()
        self.tail = bytearray()
        self.num_bytes = 0

    def add(self, chunk: bytes) -> None:
        self.num_bytes += len(chunk)
        view = memoryview(chunk)
        room = self.max_head_bytes - len(self.head)
        if room > 0:
            self.head += view[:room]
            view = view[room:]
        if not view:
            return
        if len(view) >= self.max_tail_bytes:
            self.tail[:] = view[len(view) - self.max_tail_bytes:]
            return
        excess = len(self.tail) + len(view) - self.max_tail_bytes
        if excess > 0:
            del self.tail[:excess]   # CPython moves a bytearray's start: no copy
        self.tail += view

    @property
    def num_dropped_bytes(self) -> int:
        return self.num_bytes - len(self.head) - len(self.tail)

    @property
    def truncated(self) -> bool:
        return self.num_dropped_bytes > 0

    def text(self) -> str:
        """The kept bytes as text; when truncated, the gap marked and the characters the
        cut split at either side of it left out."""
        if not self.truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", errors="replace")
        head, tail = _whole_characters(bytes(self.head), bytes(self.tail))
        middle = f"\n[... {self.num_dropped_bytes} bytes of output truncated ...]\n"
        return (head.decode("utf-8", errors="replace") + middle
                + tail.decode("utf-8", errors="replace"))


def _whole_characters(head: bytes, tail: bytes) -> tuple[bytes, bytes]:
    """`head` without a UTF-8 sequence cut at its end, `tail` without continuation
    bytes at its start (at most 3 bytes each)."""
    for back in range(1, min(4, len(head)) + 1):
        lead = head[-back]
        if lead & 0xC0 != 0x80:               # a lead byte (or ASCII)
            needed = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            if needed > back:
                head = head[:-back]
            break
    skip = 0
    while skip < min(3, len(tail)) and tail[skip] & 0xC0 == 0x80:
        skip += 1
    return head, tail[skip:]
