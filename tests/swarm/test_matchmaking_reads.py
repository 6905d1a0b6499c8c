"""hivemind's matchmaking reads its group key at a bounded rate (``swarm_opt._hivemind.averager._pace_reads``): a
real averager process leading a group that nobody joins, on a real DHT, counted where the DHT process searches."""

from __future__ import annotations

import time

import hivemind
import pytest
import torch

from swarm_opt._hivemind.averager import _READ_INTERVAL, TensorAverager
from swarm_opt.config import Timeouts

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


async def _count_reads(dht: hivemind.DHT, node) -> None:
    get_many = node.get_many

    async def counted(keys, *args, **kwargs):
        node.keys_read = getattr(node, "keys_read", []) + [str(key) for key in keys]
        return await get_many(keys, *args, **kwargs)

    node.get_many = counted


async def _keys_read(dht: hivemind.DHT, node) -> list:
    return list(getattr(node, "keys_read", []))


def test_a_leader_that_nobody_joins_reads_its_group_key_at_a_bounded_rate():
    """Alone, the peer is the best leader it can find and asks for a new read of its key as each read returns: on
    loopback, unpaced, that was about 1,500 DHT searches a second for as long as it looked."""
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    averager = None
    try:
        dht.run_coroutine(_count_reads)
        timeouts = Timeouts(matchmaking_time=1.0, averaging_timeout=3.0)
        averager = TensorAverager(dht, prefix="paced_run", templates=[torch.zeros(4)], timeouts=timeouts)
        started = time.monotonic()
        assert averager.all_reduce(lambda buffers: buffers[0].fill_(1.0), 1.0, round_id=1) is None  # no group
        looked = time.monotonic() - started
        reads = [key for key in dht.run_coroutine(_keys_read) if key.startswith("paced_run")]
        assert looked >= timeouts.matchmaking_time, looked
        # the steady pace, and a quick ramp each time a read finds news (its own declaration, renewed as it expires)
        assert 2 <= len(reads) <= 2 * looked / _READ_INTERVAL, (len(reads), looked)  # unpaced: ~4,500
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
