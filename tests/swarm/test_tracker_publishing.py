"""How often a progress tracker writes its record, on a real hivemind DHT: each write is a signed DHT store that the
nodes holding the key validate, and near an epoch's end the tracker reads (and used to write) up to 20 times a
second."""

from __future__ import annotations

import time

import hivemind
import pytest

from swarm_opt.progress import ProgressTracker

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(60)]


def test_new_samples_alone_republish_the_record_at_most_every_half_max_extrapolation():
    """Others extrapolate a record at its speed for ``max_extrapolation``, so new samples alone republish every
    ``max_extrapolation / 2``; samples without a measured speed (nothing to extrapolate) and a new epoch at once."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        tracker = ProgressTracker(dht, "publish_pace", 100_000, model_schema="m")
        stores = []  # (when, the speed the record claims)
        store = tracker._store
        tracker._store = lambda levels, value, *args: (stores.append((time.monotonic(), value["samples_per_second"])),
                                                       store(levels, value, *args))
        tracker.mark_joined()
        started, samples = time.monotonic(), 0
        measured: list = []  # the stores once the speed is measured (the first steps measure it: each publishes)
        while not measured or time.monotonic() - measured[0] < 2.5:  # a step every 50 ms, each with a read tick
            assert time.monotonic() - started < 30, stores
            samples += 8
            tracker.report(0, samples)
            tracker._publish(force=False, timeout=5.0)
            time.sleep(0.05)
            measured = [t for t, speed in stores if speed > 0]
        seen = [(round(t - started, 2), round(speed)) for t, speed in stores]
        assert 2 <= len(measured) <= 4, seen
        assert all(b - a >= 0.95 for a, b in zip(measured, measured[1:])), seen
        before = len(stores)
        tracker.report(1, 0)
        tracker._publish(force=False, timeout=5.0)
        assert len(stores) == before + 1  # a new epoch: at once
    finally:
        dht.shutdown()


def test_a_peer_that_accumulates_past_the_global_batch_claims_no_more_than_it_and_no_reader_strikes_it():
    """A peer cut off by the network keeps accumulating (its rounds cannot commit): 2of6-3min's peer claimed 439,911
    samples for a global batch of 512 and the peers of its own side ignored it as a liar, then each saw too few
    peers to commit and trained alone. Its record says the global batch at most, which a reader's plausibility
    bound never strikes, however little time it saw pass."""
    from swarm_opt import TrustConfig
    from swarm_opt.trust import ClaimChecker

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        target = 512
        tracker = ProgressTracker(dht, "accumulates", target, model_schema="m")
        tracker.report(3, 439_911)
        record = tracker._local_record()
        assert record.samples == target and tracker.progress.ready
        reader = ClaimChecker(TrustConfig())
        local = record.copy(update={"instance": "reader", "samples": 8, "samples_per_second": 10.0})
        reader.check([record.copy(update={"samples_per_second": 10.0})], local, record.time, target,
                     local_epoch_started=record.time)
        checked = reader.check([record.copy(update={"samples_per_second": 10.0})], local, record.time + 0.1, target,
                               local_epoch_started=record.time)
        assert [r.instance for r in checked.records] == [record.instance]  # counted (bounded), not ignored
    finally:
        dht.shutdown()
