"""What swarm_opt's processes ask of the DHT, counted where the DHT process searches and stores (real DHTs, a real
averager process): matchmaking reads its group key at a bounded rate (``swarm_opt._hivemind.engine._pace_reads``),
and the records written again and again (matchmaking declarations, progress records) go straight to their key's
nearest nodes (``swarm_opt._hivemind.near_store``), without the search that downloads every record under the key."""

from __future__ import annotations

import functools
import time

import hivemind
import pytest
import torch
from hivemind.utils import get_dht_time

from swarm_opt._hivemind.engine import _READ_INTERVAL
from swarm_opt._hivemind.tensor_averager import TensorAverager
from swarm_opt.config import Timeouts, TrackerConfig
from swarm_opt.progress import ProgressTracker

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


async def _record_keys(dht: hivemind.DHT, node, method: str) -> None:
    """From now on, ``node.<method>`` (``get_many``: every search for a value; ``store_many``: hivemind's store)
    remembers the keys it was called with."""
    original = getattr(node, method)

    async def recorded(keys, *args, **kwargs):
        node.recorded_keys = getattr(node, "recorded_keys", []) + [(method, str(key)) for key in keys]
        return await original(keys, *args, **kwargs)

    setattr(node, method, recorded)


def record_keys(dht: hivemind.DHT, method: str) -> None:
    dht.run_coroutine(functools.partial(_record_keys, method=method))


async def _recorded(dht: hivemind.DHT, node) -> list:
    return list(getattr(node, "recorded_keys", []))


def keys_recorded(dht: hivemind.DHT, method: str, prefix: str) -> list:
    return [key for m, key in dht.run_coroutine(_recorded) if m == method and key.startswith(prefix)]


def test_a_leader_that_nobody_joins_reads_its_group_key_at_a_bounded_rate():
    """Alone, the peer is the best leader it can find and asks for a new read of its key as each read returns: on
    loopback, unpaced, that was about 1,500 DHT searches a second for as long as it looked."""
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    averager = None
    try:
        record_keys(dht, "get_many")
        timeouts = Timeouts(matchmaking_time=1.0, averaging_timeout=3.0)
        averager = TensorAverager(dht, prefix="paced_run", templates=[torch.zeros(4)], timeouts=timeouts)
        started = time.monotonic()
        assert averager.all_reduce(lambda buffers: buffers[0].fill_(1.0), 1.0, round_id=1) is None  # no group
        looked = time.monotonic() - started
        reads = keys_recorded(dht, "get_many", "paced_run")
        assert looked >= timeouts.matchmaking_time, looked
        # the steady pace, and a quick ramp each time a read finds news (its own declaration, renewed as it expires)
        assert 2 <= len(reads) <= 2 * looked / _READ_INTERVAL, (len(reads), looked)  # unpaced: ~4,500
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


def test_declarations_go_straight_to_the_group_keys_nodes_and_are_withdrawn():
    """A peer declares itself under its group key as it starts looking, renews the declaration as it expires, and
    withdraws it as it stops. hivemind's store searched for the key each time, every node visited answering with every
    declaration under it; ours stores to the key's nearest nodes, found by a search that downloads nothing. Another
    peer reads the declaration, then its withdrawal."""
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = hivemind.DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    averager = None

    def declarations() -> list:
        found = second.get("declared_run.0b", latest=True)
        return [] if found is None else [entry.value for entry in found.value.values()]

    try:
        record_keys(first, "store_many")
        timeouts = Timeouts(matchmaking_time=0.5, averaging_timeout=10.0)
        averager = TensorAverager(first, prefix="declared_run", templates=[torch.zeros(4)], timeouts=timeouts)
        averager.schedule(get_dht_time() + 5.0, round_id=1)  # looks for a group until then
        deadline = time.monotonic() + 4.0
        while declarations() != [True] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert declarations() == [True]
        time.sleep(1.5)  # renewed at least once meanwhile (each declaration lasts matchmaking_time)
        assert declarations() == [True]
        averager.cancel_scheduled()
        deadline = time.monotonic() + 2.0
        while declarations() != [False] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert declarations() == [False]  # withdrawn
        stored = keys_recorded(first, "store_many", "declared_run")
        assert stored == [], stored  # hivemind's store: one search per declaration, renewal and withdrawal
    finally:
        if averager is not None:
            averager.shutdown()
        second.shutdown()
        first.shutdown()


def test_a_small_swarms_progress_records_go_straight_to_the_keys_nodes():
    """A swarm small enough for one progress key (every peer reads all of it with hivemind's full beam) writes it as
    shards are written: each record straight to the key's nearest nodes. Another peer's tracker reads it."""
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = hivemind.DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        record_keys(first, "store_many")
        writer = ProgressTracker(first, "near_run", 1000, model_schema="m", config=TrackerConfig())
        reader = ProgressTracker(second, "near_run", 1000, model_schema="m", config=TrackerConfig())
        writer.mark_joined()
        for epoch in range(3):
            writer.report(epoch, 40)
            writer._publish(force=True, timeout=5.0)
            reader._fetch(timeout=5.0)
            assert [record.epoch for record in reader._others] == [epoch]
        stored = keys_recorded(first, "store_many", "near_run")
        assert stored == [], stored  # hivemind's store: one search per record
    finally:
        second.shutdown()
        first.shutdown()
