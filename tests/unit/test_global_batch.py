"""The global batch: each peer computes its share of ``target_batch_size`` and then waits for the round; the speeds
the shares come from are compute speeds, not diluted by waiting."""

from __future__ import annotations

import time

import pytest

from swarm_opt import TrackerConfig
from swarm_opt.optimizer import contributed_share
from swarm_opt.progress import ProgressRecord, SwarmProgress, _Throughput, aggregate_progress, read_interval


@pytest.mark.parametrize("samples, expected", [(4, False), (8, False), (12, True), (16, True)])
def test_a_peer_stops_at_its_share_to_the_nearest_step(samples, expected):
    # a share of 10.5 in steps of 4: stop at 12, not 8
    assert contributed_share(samples=samples, batch_size=4, share=10.5) is expected
    assert not contributed_share(samples=samples, batch_size=4, share=None)  # no share known: the target decides


def _views(speeds, target, shares="speed", samples=None):
    """Each peer's view of a swarm of peers computing at ``speeds`` (records published just now)."""
    samples = samples or [0] * len(speeds)
    records = [ProgressRecord(peer_id=bytes([i]), instance=str(i), epoch=3, samples=n, samples_per_second=float(v),
                              time=100.0, client_mode=False, model_schema="s", target_batch_size=target)
               for i, (v, n) in enumerate(zip(speeds, samples))]
    return [aggregate_progress([r for r in records if r is not own], own, target, now=100.0, shares=shares)
            for own in records]


def test_without_the_others_speeds_there_is_no_share():
    assert _views([10.0, 0.0], 42)[0].share is None  # nobody else's speed known yet: no early stop
    assert _views([0.0, 10.0], 42)[0].share is None  # nor without our own
    assert _views([10.0], 42)[0].share is None  # nor alone
    assert _views([0.0, 10.0], 42, "equal")[0].share is None and _views([10.0, 0.0], 42, "equal")[0].share is None


@pytest.mark.parametrize("shares", ["speed", "equal"])
def test_shares_add_up_to_the_target_whatever_the_speeds(shares):
    speeds, batches, target = [13.3, 10.0, 8.6, 7.8], [4, 5, 6, 7], 32
    total = 0
    for view, batch in zip(_views(speeds, target, shares), batches):
        samples = batch
        while not contributed_share(samples=samples, batch_size=batch, share=view.share):
            samples += batch
        total += samples
    assert target - sum(batches) / 2 <= total <= 1.2 * target  # each to the nearest of its steps


def test_speed_shares_end_together_and_equal_shares_wait_for_the_slowest():
    speeds, target = [40.0, 20.0, 20.0, 10.0], 360
    by_speed = _views(speeds, target)
    assert [v.share for v in by_speed] == pytest.approx([160.0, 80.0, 80.0, 40.0])
    assert by_speed[0].eta == pytest.approx(100.0 + 360 / 90)  # everyone done at once
    equal = _views(speeds, target, "equal")
    assert [v.share for v in equal] == pytest.approx([90.0] * 4)
    assert equal[0].eta == pytest.approx(100.0 + 90 / 10.0)  # the slowest peer computes its 90 samples
    halfway = _views(speeds, target, "equal", samples=[90, 90, 90, 45])
    assert halfway[0].eta == pytest.approx(100.0 + 45 / 10.0) and not halfway[0].ready
    assert _views(speeds, target, "equal", samples=[90] * 4)[0].ready


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
    sampled = TrackerConfig(refresh_period=1.0, sampled_period=3.0)
    assert read_interval(snapshot(200, 0.6), 16, True, sampled) == 3.0  # a sample is extrapolated between reads
    assert read_interval(snapshot(200, 0.6), 16, True, sampled, watched=True) == 1.0  # a round looks for its group
    assert read_interval(snapshot(300, 0.0), 16, False, TrackerConfig(refresh_period=0.3)) == 0.3
    assert read_interval(snapshot(8, 3600.0, speed=0.0), 8, False, config) == 0.2  # first steps: no speed yet
    assert read_interval(snapshot(256, 0.0), 16, True, config) == config.sampled_period
    assert read_interval(snapshot(256, 0.0), 16, True, config, filling=True) == config.refresh_period
