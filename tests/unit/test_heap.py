"""The averager process keeps a round's large buffers out of glibc's heap (``swarm_opt._libc.map_blocks_from``).

Left alone, glibc raises its mmap threshold to the largest block freed so far and serves later blocks of that size
from its heap, which keeps the holes they leave: the averager's heap grew with every round cut short by a dead
groupmate (``benchmarks/soak.py --diagnose``). Each check runs in a fresh interpreter: the threshold is per process
and, once set, stays."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swarm_opt import testing
from swarm_opt._libc import glibc_heap

pytestmark = pytest.mark.skipif(not glibc_heap(), reason="glibc's heap (mallinfo2) only")

ROUND = """
import json, sys
from swarm_opt._libc import glibc_heap, map_blocks_from
if sys.argv[1] == "1":
    assert map_blocks_from(128 * 1024)
block = bytearray(300_000)
del block  # a block freed: glibc would serve blocks of this size from its heap from now on
before = glibc_heap()
parts = [bytearray(300_000) for _ in range(10)]  # a round's parts
after = glibc_heap()
print(json.dumps({key: after[key] - before[key] for key in ("mmapped", "arena")}))
"""


def _round(mapped: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", ROUND, str(int(mapped))], capture_output=True, text=True,
                          env=testing.peer_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_rounds_large_blocks_get_mappings_of_their_own_given_back_when_freed():
    grown = _round(mapped=True)
    assert grown["mmapped"] >= 10 * 300_000 and grown["arena"] < 300_000, grown


def test_without_it_glibc_serves_them_from_its_heap():
    """The control: what the averager process did before."""
    grown = _round(mapped=False)
    assert grown["mmapped"] < 300_000 and grown["arena"] >= 10 * 300_000 - 1_000_000, grown
