"""Sharded progress records: shard assignment, the sample's coverage and scale, levels, and the estimate they give
(no network: the sample is fed the records a DHT read would return)."""

from __future__ import annotations

import random

import pytest
from hivemind.utils import ValueWithExpiration

from swarm_opt import ConfigError, TrackerConfig
from swarm_opt.progress import ProgressRecord, SampledRecords, aggregate_progress, parse_records
from swarm_opt.sharding import (
    MAX_LEVEL,
    ShardSample,
    all_shard_keys,
    owner_hash,
    peers_upper_bound,
    progress_key,
    shard_key,
    shard_of,
)
from swarm_opt.trust import ClaimChecker


def subkey(i: int) -> bytes:
    return b"[owner:key-%d]/inst%d" % (i, i)


def record(i: int, epoch: int, samples: int, sps: float, t: float) -> ProgressRecord:
    return ProgressRecord(peer_id=b"peer%d" % i, instance=f"i{i}", epoch=epoch, samples=samples,
                          samples_per_second=float(sps), time=float(t), client_mode=False, model_schema="s",
                          target_batch_size=10**6)


class Swarm:
    """N peers at known throughputs, their records placed in shards as writers would place them."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.rates = [rng.uniform(5.0, 15.0) for _ in range(n)]
        self.owners = [owner_hash(subkey(seed * n + i)) for i in range(n)]  # seeds draw different signing keys

    def shard(self, shard, t: float, epoch_start: float = 0.0) -> list:
        return [record(i, 0, int(rate * (t - epoch_start)), rate, t) for i, (rate, owner) in
                enumerate(zip(self.rates, self.owners)) if shard_of(owner, shard[0]) == shard]

    def exact(self, t: float) -> float:
        return sum(int(rate * t) for rate in self.rates)


def test_keys_shards_and_owners():
    assert shard_key("r", (0, 0)) == progress_key("r") == "r_swarm_progress"
    assert shard_key("r", (3, 5)) == "r_swarm_progress_3_5"
    assert len(all_shard_keys("r")) == 2 ** (MAX_LEVEL + 1) - 1
    owner = owner_hash(subkey(7))
    assert owner is not None and owner_hash(b"no owner here") is None
    # levels nest: a peer's shard at level c + 1 is one of the two halves of its shard at level c
    for level in range(MAX_LEVEL):
        assert shard_of(owner, level + 1)[1] % 2 ** level == shard_of(owner, level)[1]
    # the shard is the key's: another instance of the same key lands in the same shard
    assert owner_hash(b"[owner:key-7]/other") == owner


def test_owners_spread_evenly_over_shards():
    counts = [0] * 16
    for i in range(1600):
        counts[shard_of(owner_hash(subkey(i)), 4)[1]] += 1
    assert min(counts) > 60 and max(counts) < 140


def test_a_record_stored_under_a_shard_its_key_does_not_hash_to_is_dropped():
    owner = owner_hash(subkey(1))
    home, away = shard_of(owner, 3), (3, (shard_of(owner, 3)[1] + 1) % 8)
    entries = {subkey(1): ValueWithExpiration(record(1, 0, 5, 1.0, 10.0).dict(), 1e12)}
    raw = ValueWithExpiration(entries, 1e12)
    assert len(parse_records(raw, model_schema="s", now=10.0, shard=home)[0]) == 1
    assert parse_records(raw, model_schema="s", now=10.0, shard=away)[0] == []
    unsigned = ValueWithExpiration({b"no-owner": entries[subkey(1)]}, 1e12)
    assert parse_records(unsigned, model_schema="s", now=10.0, shard=home)[0] == []
    assert len(parse_records(unsigned, model_schema="s", now=10.0)[0]) == 1  # level 0 holds everyone


def test_levels_follow_the_swarm_with_hysteresis_and_writers_cover_readers():
    sample = ShardSample(exact_up_to=16, shard_size=16, horizon=30.0)
    sample.observe(9)
    assert sample.level == 0 and sample.publish_levels() == {0}  # a small swarm: one key, read whole
    sample.observe(16)
    assert sample.level == 0 and sample.publish_levels() == {0, 1}  # also where readers at level 1 would look
    sample.observe(20)
    assert sample.level == 0  # within the hysteresis
    sample.observe(21)
    assert sample.level == 1
    for n in (30, 35, 40):
        sample.observe(n)
    assert sample.level == 1
    big = ShardSample(exact_up_to=16, shard_size=16, horizon=30.0)
    big.settle([0] * 6 + [15] + [0] * (MAX_LEVEL - 6))  # a probe found 15 records in our level-6 shard
    assert big.level == 6 and big.peers == 1 + 15 * 64
    assert_readers_find_writers(exact_up_to=16, shard_size=16, swarm_sizes=(100, 300, 1000, 3000))


def assert_readers_find_writers(*, exact_up_to: int, shard_size: int, swarm_sizes: tuple) -> None:
    """A reader whose estimate differs by up to 1.28x from the writer's reads a level the writer publishes at."""
    for writer_peers in swarm_sizes:
        writer = ShardSample(exact_up_to=exact_up_to, shard_size=shard_size, horizon=30.0)
        writer.observe(writer_peers)
        for factor in (1 / 1.27, 1.0, 1.27):
            reader = ShardSample(exact_up_to=exact_up_to, shard_size=shard_size, horizon=30.0)
            reader.observe(writer_peers * factor)
            assert reader.level in writer.publish_levels(), (writer_peers, factor)


def test_the_default_keeps_small_swarms_exact_and_reads_small_shards_in_large_ones():
    """``TrackerConfig()``: one key up to 16 peers (20 with the hysteresis), shards of ~8 records above; the level
    whose shards would hold fewer than 16 peers in all is passed through, and nobody publishes there."""
    config = TrackerConfig()
    sample = ShardSample(exact_up_to=config.exact_up_to, shard_size=config.shard_size, horizon=30.0)
    for n in (5, 16, 20):
        sample.observe(n)
        assert sample.level == 0
    sample.observe(21)
    assert sample.level == 2 and 1 not in sample.publish_levels() and 0 in sample.publish_levels()
    for _ in range(10):  # estimates are smoothed once sharded
        sample.observe(12)
    assert sample.level == 0
    large = ShardSample(exact_up_to=config.exact_up_to, shard_size=config.shard_size, horizon=30.0)
    large.observe(1000)
    assert large.level == 7 and large.publish_levels() == {7}  # 128 shards of ~8: one write per period
    assert_readers_find_writers(exact_up_to=config.exact_up_to, shard_size=config.shard_size,
                                swarm_sizes=(25, 100, 300, 1000))


def test_held_shards_are_disjoint_scale_and_expire():
    sample = ShardSample(exact_up_to=16, shard_size=16, horizon=10.0, rng=random.Random(0))
    sample.level = 2
    sample.add((2, 1), ["a"], now=0.0)
    sample.add((2, 3), ["b"], now=1.0)
    assert sample.coverage == 0.5 and sample.scale == 2.0
    sample.add((1, 1), ["c"], now=2.0)  # covers (2, 1) and (2, 3): replaces both
    assert sample.records(2.0) == ["c"] and sample.coverage == 0.5
    assert sample.next_read() in {(2, 0), (2, 2)}  # never-read shards first
    sample.add((2, 0), ["d"], now=3.0)
    assert sample.next_read() == (2, 2)
    sample.add((2, 2), ["e"], now=4.0)
    assert sample.coverage == 1.0 and sample.next_read() in {(2, 1), (2, 3)}  # the oldest: read at t=2
    assert sorted(sample.records(12.5)) == ["d", "e"]  # the level-1 read expired


def test_a_peer_that_moves_up_a_level_keeps_the_whole_swarm_in_view_until_it_read_each_finer_shard():
    """At a swarm's start every peer reads the one key, finds more peers than it holds and moves up a level: its first
    read there replaces the key's records with one shard's. Estimated from that shard alone (scaled by 2), a shard
    that happens to hold the fast peers fires the epoch trigger early (a first epoch of 272 samples for 320, seen in
    CI); the records of the other half, read a moment ago, stand until that half is read."""
    swarm = Swarm(6, seed=3)
    everyone = swarm.shard((0, 0), 1.0)
    sample = ShardSample(exact_up_to=2, shard_size=2, horizon=10.0, rng=random.Random(0))
    sample.add((0, 0), everyone, now=1.0, owners=swarm.owners)
    sample.observe(1 + len(everyone))
    assert sample.level == 2
    first = sample.next_read()
    sample.add(first, swarm.shard(first, 1.5), now=1.5, owners=[o for o in swarm.owners if shard_of(o, 2) == first])
    assert sample.coverage == 1.0 and sample.scale == 1.0 and sample.shards_held == 4
    assert sorted(r.instance for r in sample.records(1.5)) == sorted(r.instance for r in everyone)
    assert sample.next_read() != first  # a refiled part, read at 1.0, is read next
    # records whose signer is unknown cannot be placed: they leave with the coarse shard, as before
    blind = ShardSample(exact_up_to=2, shard_size=2, horizon=10.0)
    blind.add((0, 0), everyone, now=1.0)
    blind.add((1, 0), [], now=1.5)
    assert blind.coverage == 1.0 and blind.records(1.5) == []


def test_the_reads_of_many_peers_spread_over_the_shards():
    first = [ShardSample(exact_up_to=16, shard_size=16, horizon=30.0, rng=random.Random(seed)) for seed in range(64)]
    for sample in first:
        sample.level = 3
    hits = [0] * 8
    for sample in first:
        hits[sample.next_read()[1]] += 1
    assert max(hits) <= 20


def estimate(swarm: Swarm, n_shards_read: int, level: int, t: float, seed: int, horizon: float = 1e9) -> float:
    """What a peer estimates at time ``t`` after reading ``n_shards_read`` shards at ``level``, one per second."""
    sample = ShardSample(exact_up_to=16, shard_size=16, horizon=horizon, rng=random.Random(seed))
    sample.level = level
    for k in range(n_shards_read):
        read_at = t - (n_shards_read - 1 - k)
        shard = sample.next_read()
        sample.add(shard, swarm.shard(shard, read_at), now=read_at)
    local = record(10**6, 0, 0, 0.0, t)
    return aggregate_progress(sample.records(t), local, 10**9, now=t, max_extrapolation=1e9,
                              scale=sample.scale).samples_accumulated


def test_a_sample_that_covers_every_shard_is_exact_and_a_partial_one_is_unbiased():
    swarm = Swarm(1000)
    t = 100.0
    exact = swarm.exact(t)
    assert estimate(swarm, 64, 6, t, seed=0) == pytest.approx(exact, rel=1e-3)  # stale records extrapolated
    errors = [estimate(swarm, 10, 6, t, seed=seed) / exact - 1 for seed in range(100)]
    mean = sum(errors) / len(errors)
    spread = (sum(e * e for e in errors) / len(errors)) ** 0.5
    assert abs(mean) < 0.02  # unbiased: within ±10 % on average, by far
    assert 0.02 < spread < 0.12  # ~sqrt((1 - f) / n) * sqrt(1 + CV^2) with f = 10/64, n ~ 156
    # the default shard size at 1,000 peers: level 7, 10 of 128 shards of ~8 held
    errors = [estimate(swarm, 10, 7, t, seed=seed) / exact - 1 for seed in range(100)]
    mean = sum(errors) / len(errors)
    spread = (sum(e * e for e in errors) / len(errors)) ** 0.5
    assert abs(mean) < 0.03 and 0.03 < spread < 0.16, (mean, spread)  # f = 10/128, n ~ 78: about 11 %




def sampled_progress(swarm: Swarm, level: int, shards_read: int, seed: int):
    """What a peer sees after reading ``shards_read`` shards of ``swarm`` at ``level``, all at time 1."""
    sample = ShardSample(exact_up_to=16, shard_size=16, horizon=1e9, rng=random.Random(seed))
    sample.level = level
    for _ in range(shards_read):
        shard = sample.next_read()
        sample.add(shard, swarm.shard(shard, 1.0), now=1.0)
    return aggregate_progress(sample.records(1.0), record(10**6, 0, 0, 0.0, 1.0), 10**9, now=1.0, scale=sample.scale)


def test_scaled_counts_estimate_the_swarm_size():
    assert 800 < sampled_progress(Swarm(1000), level=6, shards_read=16, seed=1).num_peers < 1200


def test_majorities_are_measured_against_a_bound_that_a_sample_rarely_falls_under():
    """A sampled view's ``max_peers`` (what a round's majority is measured against) is at least the live peers in
    nearly every draw, where the estimate is under them in about half; a full view is exact. Swarms of 4 and 1,000
    other peers (5 and 1,001 live with the reader), read as a newcomer (one shard of 2 or of 64) and as a settled
    peer (10 of 64)."""
    assert peers_upper_bound(7, 1.0) == 7 and peers_upper_bound(0, 1.0) == 0
    assert [round(peers_upper_bound(h, 0.5), 1) for h in (0, 1, 2)] == [4.0, 7.5, 10.5]  # monotone, above h / f
    for n, level, reads in ((4, 1, 1), (1000, 6, 1), (1000, 6, 10)):
        views = [sampled_progress(Swarm(n, seed=seed), level, reads, seed) for seed in range(300)]
        live = n + 1
        under_bound = sum(v.max_peers < live for v in views) / len(views)
        under_estimate = sum(v.num_peers < live for v in views) / len(views)
        assert under_bound <= 0.05 < 0.2 < under_estimate, (n, reads, under_bound, under_estimate)
        assert all(v.max_peers >= v.num_peers for v in views)
    full = sampled_progress(Swarm(40), 1, 2, 0)
    assert full.max_peers == full.num_peers == 41


def test_a_sample_is_filling_until_it_covers_what_a_horizon_of_reads_covers():
    """A newcomer reads at the refresh pace until it holds what its steady reads keep (every shard of a small level,
    ``sample_horizon / sampled_period`` of a large one), so that its wide bound narrows within seconds."""
    records = SampledRecords(None, "run", model_schema=None, config=TrackerConfig(sample_horizon=30.0,
                                                                                 sampled_period=3.0))
    assert not records.filling  # level 0: one key, read whole
    for level, settled in ((1, 2), (6, 10)):
        records.sample = ShardSample(exact_up_to=16, shard_size=16, horizon=30.0)
        records.sample.level = level
        for index in range(settled):
            assert records.filling, (level, index)
            records.sample.add((level, index), [], now=1.0)
        assert not records.filling


def test_a_liar_in_a_sampled_shard_moves_the_estimate_only_as_far_as_trust_bounds_it():
    """A liar claiming a huge sample count in its shard: the claim checker caps it at a plausible rate, so even
    scaled by 1/f it moves the estimate of a reader that holds its shard by a few percent."""
    swarm = Swarm(1000)
    t = 10.0
    sample = ShardSample(exact_up_to=16, shard_size=16, horizon=1e9, rng=random.Random(2))
    sample.level = 6
    liar_owner = owner_hash(b"[owner:liar]/x")
    liar = record(-1, 0, 10**7, 1e6, t)
    for k in range(10):
        shard = sample.next_read() if k else shard_of(liar_owner, 6)
        held = swarm.shard(shard, t) + ([liar] if shard == shard_of(liar_owner, 6) else [])
        sample.add(shard, held, now=t)
    checker = ClaimChecker()
    local = record(10**6, 0, int(10 * t), 10.0, t)
    honest = [r for r in sample.records(t) if r.peer_id != liar.peer_id]
    bounded = checker.check(sample.records(t), local, now=t, target_batch_size=10**6, local_epoch_started=0.0).records
    with_liar = aggregate_progress(bounded, local, 10**9, now=t, max_extrapolation=0.0, scale=sample.scale)
    without = aggregate_progress(honest, local, 10**9, now=t, max_extrapolation=0.0, scale=sample.scale)
    assert liar.peer_id not in {r.peer_id for r in bounded} or \
        with_liar.samples_accumulated <= without.samples_accumulated * 1.05


def test_tracker_config_validates_the_sampling_knobs():
    with pytest.raises(ConfigError, match="shard_size"):
        TrackerConfig(shard_size=0)
    with pytest.raises(ConfigError, match="exact_up_to"):
        TrackerConfig(exact_up_to=0)
    with pytest.raises(ConfigError, match="sample_horizon"):
        TrackerConfig(sample_horizon=-1.0)
    with pytest.raises(ConfigError, match="sampled_period"):
        TrackerConfig(sampled_period=0.0)


def test_a_shard_that_says_the_swarm_moved_on_has_the_held_shards_re_read_at_once():
    """Half of the records held must reach an epoch before it is believed, and most were read before the swarm's
    last round: when the shard read last says most of its peers passed the believed epoch, the other held shards are
    re-read at once (once each), not one per ``sampled_period``; a shard whose majority did not pass, or another
    shard ahead while the belief has not moved (whatever epoch it claims), starts no burst; one full key (level 0)
    never does."""
    records = SampledRecords(None, "run", model_schema=None, config=TrackerConfig())
    records.sample.level = 2
    for index in range(4):
        records._hold((2, index), [record(10 * index + i, 5, 0, 1.0, 0.0) for i in range(5)], now=1.0)
    assert not records.confirm(believed=5)
    records._hold((2, 0), [record(i, 6 if i < 3 else 5, 0, 1.0, 0.0) for i in range(5)], now=2.0)
    assert [records.confirm(believed=5) for _ in range(4)] == [True, True, True, False]  # three re-reads
    assert not records.confirm(believed=5)  # the same epoch again: no second burst
    assert not records.confirm(believed=6)
    records._hold((2, 1), [record(10 + i, 7 if i < 2 else 6, 0, 1.0, 0.0) for i in range(5)], now=3.0)
    assert not records.confirm(believed=6)  # two of five passed: no majority
    records._hold((2, 1), [record(10 + i, 7, 0, 1.0, 0.0) for i in range(5)], now=3.0)
    assert records.confirm(believed=6)  # a newer epoch: a new burst
    assert [records.confirm(believed=6) for _ in range(3)] == [True, True, False]  # three re-reads in all
    records._hold((2, 2), [record(20 + i, 10 ** 6, 0, 1.0, 0.0) for i in range(5)], now=4.0)
    assert not records.confirm(believed=6)  # liars claiming epochs far ahead: still one burst per epoch believed
    records.sample.level = 0
    assert not records.confirm(believed=6)
