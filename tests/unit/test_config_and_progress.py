"""Configuration validation and the progress maths: no network."""

from __future__ import annotations

import math

import pytest
from hivemind.utils import ValueWithExpiration

from swarm_opt import ConfigError, ConfigTypeError, SwarmConfig, Timeouts, TrackerConfig
from swarm_opt.progress import ProgressRecord, aggregate_progress, parse_records


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(run_id="r", target_batch_size=0), ConfigError, "target_batch_size must be a positive int"),
        (dict(run_id="r", target_batch_size=-5), ConfigError, "target_batch_size"),
        (dict(run_id="r", target_batch_size=2.5), ConfigTypeError, "target_batch_size"),
        (dict(run_id="r", target_batch_size=True), ConfigTypeError, "target_batch_size"),
        (dict(run_id="r", target_batch_size=8, batch_size_per_step=0), ConfigError, "batch_size_per_step"),
        (dict(run_id="has.dot", target_batch_size=8), ConfigError, "run_id"),
        (dict(run_id="", target_batch_size=8), ConfigError, "run_id"),
    ],
)
def test_swarm_config_rejects_bad_input_with_a_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        SwarmConfig(**kwargs)


def test_timeouts_and_tracker_config_validate():
    with pytest.raises(ConfigError, match="must exceed matchmaking_time"):
        Timeouts(matchmaking_time=10, averaging_timeout=5)
    with pytest.raises(ConfigError, match="positive, finite"):
        Timeouts(matchmaking_time=math.inf)
    with pytest.raises(ConfigError, match="twice heartbeat_period"):
        TrackerConfig(heartbeat_period=5, record_ttl=6)
    with pytest.raises(ConfigError, match="max_extrapolation"):
        TrackerConfig(max_extrapolation=-1)
    with pytest.raises(ConfigError, match="'equal' gives every peer the same steps"):
        TrackerConfig(shares="even")
    assert Timeouts(matchmaking_time=1.0).request_timeout < 1.0  # hivemind needs it below the matchmaking time
    assert isinstance(ConfigError("x"), ValueError) and isinstance(ConfigTypeError("x"), TypeError)


def record(peer: bytes, epoch: int, samples: int, sps: float, t: float, **kw) -> ProgressRecord:
    return ProgressRecord(peer_id=peer, instance=peer.hex(), epoch=epoch, samples=samples,
                          samples_per_second=float(sps), time=float(t), client_mode=kw.get("client_mode", False),
                          model_schema=kw.get("schema", "s"), target_batch_size=100)


def test_aggregate_counts_only_the_global_epoch_and_extrapolates_samples():
    local = record(b"me", 3, 10, 10.0, 100.0)
    others = [record(b"a", 3, 20, 5.0, 98.0), record(b"b", 2, 500, 100.0, 100.0, client_mode=True)]
    p = aggregate_progress(others, local, target_batch_size=100, now=100.0)
    assert p.epoch == 3 and p.num_peers == 3 and p.num_clients == 1
    # peer b is in an older epoch; a has more than its share of the target (5/115 of 100) and is not extrapolated
    assert p.samples_accumulated == 10 + 20
    assert p.samples_per_second == pytest.approx(115.0)
    assert p.eta == pytest.approx(100.0 + 70 / 115.0)
    assert not p.ready
    p = aggregate_progress(others[:1], local, target_batch_size=100, now=100.0)
    assert p.samples_accumulated == 10 + 20 + 5 * 2  # a's share is 5/15 of 100: extrapolated by 2 s at its speed


def test_a_peer_is_extrapolated_up_to_its_share_of_the_target_where_it_stops_computing():
    local = record(b"me", 1, 10, 30.0, 100.0)
    other = record(b"a", 1, 20, 10.0, 99.0)  # a quarter of the swarm's speed: a share of 25 of 100
    assert aggregate_progress([other], local, 100, now=100.0).samples_accumulated == 10 + 25


def test_peers_that_finished_the_round_with_us_count_before_their_records_catch_up():
    local = record(b"me", 5, 10, 10.0, 100.0)
    stale = [record(b"a", 4, 90, 20.0, 97.0), record(b"b", 3, 90, 20.0, 97.0)]
    p = aggregate_progress(stale, local, target_batch_size=100, now=100.0, epoch_started=99.0)
    assert p.epoch == 5
    assert p.samples_accumulated == 10 + 20  # a: 20 samples/s for the 1 s since we all started epoch 5; b is behind
    assert aggregate_progress(stale, local, 100, now=100.0).samples_accumulated == 10  # without the start time


def test_a_peer_that_stopped_reporting_is_not_extrapolated_forever():
    local = record(b"me", 1, 0, 0.0, 100.0)
    idle = record(b"a", 1, 40, 10.0, 90.0)  # its last record is 10 s old: it stopped adding samples
    assert aggregate_progress([idle], local, 100, now=100.0, max_extrapolation=2.0).samples_accumulated == 60


def test_a_peer_whose_speed_is_not_measured_counts_at_the_typical_speed_early_in_the_epoch_only():
    local = record(b"me", 2, 32, 100.0, 100.0)
    others = [record(b"a", 2, 32, 0.0, 99.0),  # computes, speed not published yet
              record(b"b", 2, 0, 0.0, 99.0),  # its first step may still be on its way
              record(b"c", 2, 64, 300.0, 99.0)]
    # in the epoch's first max_extrapolation seconds a and b count at the median measured speed (of 100 and 300)
    early = aggregate_progress(others, local, 1000, now=100.0, epoch_started=99.0, max_extrapolation=2.0)
    assert early.samples_per_second == pytest.approx(100.0 + 200.0 + 200.0 + 300.0)
    # never extrapolated at the guess: a and b count as published; c is extrapolated for 1 s at its own speed
    assert early.samples_accumulated == 32 + 32 + 0 + 64 + 300
    # later, a peer still unmeasured is slow (or skips its steps): counted at nothing, so nobody stops early for it
    late = aggregate_progress(others, local, 1000, now=100.0, epoch_started=95.0, max_extrapolation=2.0)
    assert late.samples_per_second == pytest.approx(100.0 + 300.0)
    alone = aggregate_progress([record(b"a", 2, 32, 0.0, 99.0)], record(b"me", 2, 0, 0.0, 100.0), 1000, now=100.0,
                               epoch_started=99.5)
    assert alone.samples_per_second == 0.0  # nothing measured: nothing guessed


def test_aggregate_sees_a_swarm_ahead_and_readiness():
    local = record(b"me", 1, 0, 0.0, 50.0)
    p = aggregate_progress([record(b"a", 4, 7, 1.0, 50.0)], local, target_batch_size=10, now=50.0)
    assert p.epoch == 4  # the caller must catch up
    p = aggregate_progress([record(b"a", 1, 12, 0.0, 50.0)], local, target_batch_size=10, now=50.0)
    assert p.ready and p.eta_seconds == 0


def _raw(entries: dict) -> ValueWithExpiration:
    return ValueWithExpiration({k: ValueWithExpiration(v, 1e12) for k, v in entries.items()}, 1e12)


def test_parse_records_drops_malformed_hostile_and_foreign_records():
    good = record(b"a", 1, 5, 1.0, 10.0).dict()
    raw = _raw({
        b"k1": good,
        b"k2": dict(good, samples=-1),                      # out of range
        b"k3": dict(good, samples_per_second=float("nan")),  # not finite
        b"k4": dict(good, epoch="1"),                        # wrong type
        b"k5": dict(good, time=10.0 + 3600),                 # from the far future
        b"k6": dict(good, model_schema="other"),             # a different model
        b"k7": "garbage",
        b"k8": None,                                          # a peer that left
        b"k9": {**good, "samples_per_second": 1e30},        # absurd throughput
    })
    records, mismatched = parse_records(raw, model_schema="s", now=10.0)
    assert [r.peer_id for r in records] == [b"a"]
    assert mismatched == ["other"]
    assert parse_records(None, model_schema="s", now=0.0) == ([], [])
    assert parse_records(ValueWithExpiration("junk", 1.0), model_schema="s", now=0.0) == ([], [])
