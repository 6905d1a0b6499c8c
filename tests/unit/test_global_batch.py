"""The global batch: each peer computes its share of ``target_batch_size`` and then waits for the round; the speeds
the shares come from are compute speeds, not diluted by waiting."""

from __future__ import annotations

import time

import pytest

from swarm_opt import TrackerConfig
from swarm_opt.optimizer import contributed_share
from swarm_opt.progress import SwarmProgress, _Throughput, read_interval


@pytest.mark.parametrize("samples, expected", [(4, False), (8, False), (12, True), (16, True)])
def test_a_peer_stops_at_its_share_to_the_nearest_step(samples, expected):
    # a quarter of the swarm's speed: a share of 10.5 of a global batch of 42, in steps of 4 (stop at 12, not 8)
    assert contributed_share(samples=samples, batch_size=4, own_rate=10.0, swarm_rate=40.0,
                             target_batch_size=42) is expected


def test_without_the_others_speeds_only_the_target_counts():
    for swarm_rate in (0.0, 10.0):  # nobody else's speed known yet: the share is the whole batch, i.e. no early stop
        assert not contributed_share(samples=40, batch_size=4, own_rate=10.0, swarm_rate=swarm_rate,
                                     target_batch_size=42)
    assert not contributed_share(samples=40, batch_size=4, own_rate=0.0, swarm_rate=40.0, target_batch_size=42)


def test_shares_add_up_to_the_target_whatever_the_speeds():
    speeds, batches, target = [13.3, 10.0, 8.6, 7.8], [4, 5, 6, 7], 32
    total = 0
    for speed, batch in zip(speeds, batches):
        samples = batch
        while not contributed_share(samples=samples, batch_size=batch, own_rate=speed, swarm_rate=sum(speeds),
                                    target_batch_size=target):
            samples += batch
        total += samples
    assert target <= total <= 1.2 * target


def test_throughput_is_compute_speed_not_diluted_by_waiting():
    throughput = _Throughput()
    throughput.update(0)
    time.sleep(1.0)  # waiting for the swarm before training: not compute
    for samples in (10, 20, 30):
        throughput.update(samples)
        time.sleep(0.05)
    time.sleep(1.0)  # waiting for a round: not compute either
    assert throughput.update(30) > 80  # 10 samples per 0.05 s = 200/s; diluted by the waits it would be ~14
    throughput.restart()  # a new epoch
    throughput.update(0)
    time.sleep(0.05)
    assert throughput.update(10) > 80


def test_reads_come_often_near_the_target_and_seldom_once_it_is_reached():
    """Near the end of an epoch a read every third of the ETA (the trigger's accuracy depends on fresh records);
    once the swarm reached the target, twice a second: while the round forms every peer would otherwise read 20
    times a second, and the DHT nodes storing the key serve all of them."""
    config = TrackerConfig()

    def snapshot(samples: int, eta_seconds: float, speed: float = 100.0) -> SwarmProgress:
        return SwarmProgress(epoch=3, samples_accumulated=samples, target_batch_size=256, num_peers=4, num_clients=0,
                             samples_per_second=speed, eta=100.0 + eta_seconds, time=100.0)

    assert read_interval(snapshot(0, 30.0), 0, False, config) == config.refresh_period
    assert read_interval(snapshot(200, 0.6), 16, False, config) == pytest.approx(0.2)
    assert read_interval(snapshot(250, 0.01), 16, False, config) == 0.05
    assert read_interval(snapshot(256, 0.0), 16, False, config) == 0.5  # reached: the round is forming
    assert read_interval(snapshot(300, 0.0), 16, False, TrackerConfig(refresh_period=0.3)) == 0.3
    assert read_interval(snapshot(8, 3600.0, speed=0.0), 8, False, config) == 0.2  # first steps: no speed yet
    assert read_interval(snapshot(256, 0.0), 16, True, config) == config.sampled_period
    assert read_interval(snapshot(256, 0.0), 16, True, config, filling=True) == config.refresh_period
