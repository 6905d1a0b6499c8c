"""``swarm_opt._procfs``: a process's memory as Linux accounts it, read once for the harness, traces and benchmarks."""

from __future__ import annotations

import os

import pytest

from swarm_opt._procfs import mappings, memory_rollup


def test_a_block_the_process_writes_shows_in_its_private_memory_and_its_mappings():
    before = memory_rollup()
    block = bytearray(64 << 20)  # written (zeroed) by Python, so resident and private
    block[::4096] = b"\1" * len(block[::4096])
    after = memory_rollup(os.getpid())
    assert after["USS"] - before["USS"] >= 60 << 20
    assert after["anon"] - before["anon"] >= 60 << 20
    assert before["Pss"] <= before["Rss"]
    assert any(name.endswith(" anon") and rss >= 60 << 20 for name, rss in mappings().items())
    del block


def test_a_process_that_is_gone_is_said_so():
    with pytest.raises(OSError):
        memory_rollup(2 ** 22 + 1)  # above the kernel's pid_max limit
    assert mappings(pid=2 ** 22 + 1) == {}
