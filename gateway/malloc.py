"""glibc's malloc, set for Undertow's long-lived processes: the gateway (`app.tune_malloc`)
and the built-in engine (`builtin_engine/memory.py`) each say how much freed memory to keep,
and when to hand it back. Where the C library is not glibc nothing happens."""

import ctypes
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MAX_MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest on 64-bit


def keep_freed(trim_threshold_bytes: int,
               mmap_threshold_bytes: int = MAX_MMAP_THRESHOLD_BYTES) -> bool:
    """Blocks up to `mmap_threshold_bytes` come from the heap (not a mapping of their own),
    and up to `trim_threshold_bytes` of free heap top is kept; whether it applied."""
    libc = _glibc()
    return libc is not None and bool(
        libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold_bytes)
        and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold_bytes))


def hand_back() -> None:
    """Returns the free memory of every arena to the system (`malloc_trim`)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _glibc():
    return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None
