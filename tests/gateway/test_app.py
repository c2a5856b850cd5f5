"""The gateway process's settings (`gateway/front/app.py`): what `serve` changes process-wide."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Reads a 3.5 MB body as aiohttp does (a buffer grown by 256 kB pieces, then copied to
# bytes) 20 times, and prints the minor page faults per body.
READ_BODIES = """
import resource, sys
from undertow.gateway.front.app import tune_malloc
if sys.argv[1] == "tuned":
    assert tune_malloc()
piece = bytes(256 * 1024)
def read_body(num_pieces):
    body = bytearray()
    for _ in range(num_pieces):
        body.extend(piece)
    return bytes(body)
for _ in range(3):
    read_body(14)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for number in range(20):
    body = read_body(14 + number % 2)
    del body
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def faults_per_body(mode: str) -> float:
    return float(subprocess.run([sys.executable, "-c", READ_BODIES, mode], check=True,
                                capture_output=True, text=True).stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_tune_malloc_keeps_freed_body_memory_instead_of_faulting_it_in_again():
    # by default each body's ~900 pages are mapped and faulted in anew
    assert faults_per_body("default") > 400
    assert faults_per_body("tuned") < 50
