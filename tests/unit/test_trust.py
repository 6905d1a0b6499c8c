"""Bounded trust in progress records (swarm_opt.trust): liars move the swarm no further than they plausibly could."""

from __future__ import annotations

import logging

import pytest

from swarm_opt import ConfigError, TrustConfig
from swarm_opt.progress import ProgressRecord, aggregate_progress
from swarm_opt.trust import ClaimChecker, believed_epoch, lower_median

TARGET = 256


def rec(name: str, epoch: int, samples: int, sps: float, t: float) -> ProgressRecord:
    return ProgressRecord(peer_id=name.encode(), instance=name, epoch=epoch, samples=samples,
                          samples_per_second=float(sps), time=float(t), client_mode=False, model_schema="s",
                          target_batch_size=TARGET)


def test_believed_epoch_needs_half_of_the_peers():
    assert believed_epoch([5, 5, 5, 1005], 5) == 5  # one liar ahead of three
    assert believed_epoch([6, 6, 5], 5) == 6  # a majority committed a round: the third follows
    assert believed_epoch([6, 5], 5) == 6  # two peers: one ahead is half
    assert believed_epoch([7, 0, 7], 0) == 7  # a newcomer believes the swarm
    assert believed_epoch([3, 9], 9) == 9  # never behind our own epoch
    assert believed_epoch([], None) == 0
    assert lower_median([1.0, 1e9]) == 1.0 and lower_median([3.0, 1.0, 2.0]) == 2.0


def test_an_epoch_ahead_needs_half_of_the_peers_seen_lately_not_only_of_those_read():
    """Right after a partition heals, a read may reach one side's DHT nodes only: two peers that trained on alone,
    far ahead, must not pass for the swarm to a peer of the four that stayed together (it would download their
    state), nor pull back a peer of theirs that just took the four's state."""
    assert believed_epoch([320, 320, 168], 168) == 320  # what the three records read alone say
    assert believed_epoch([320, 320, 168], 168, voters=6) == 168  # six peers seen within forget_after
    assert believed_epoch([169, 169, 169, 168], 168, voters=6) == 169  # three of six committed a round
    assert believed_epoch([320, 320], 320, voters=6) == 320  # never behind our own epoch
    checker = ClaimChecker(TrustConfig(ahead_grace=30.0))
    local = rec("me", 168, 10, 10.0, 100.0)
    read = [rec("a", 320, 0, 10.0, 100.0), rec("b", 320, 0, 10.0, 100.0)]
    assert aggregate_progress(checker.check(read, local, 100.0, TARGET).records, local, TARGET, 100.0).epoch == 320
    side = [(b"c", "c"), (b"d", "d"), (b"e", "e")]  # this side's peers, not in this read
    checked = checker.check(read, local, 101.0, TARGET, remembered=side + [(b"a", "a")])
    assert checked.records == [] and checked.ahead == 2
    assert aggregate_progress(checked.records, local, TARGET, 101.0, ahead=checked.ahead).epoch == 168


def test_a_peer_claiming_an_epoch_far_ahead_is_not_counted_and_then_ignored(caplog):
    checker = ClaimChecker(TrustConfig(ahead_grace=5.0, ignore_seconds=60.0))
    seen_epoch_begin(checker, 5, 99.0)
    local = rec("me", 5, 10, 10.0, 100.0)
    honest = [rec("a", 5, 20, 10.0, 100.0), rec("b", 5, 30, 10.0, 100.0)]
    liar = rec("liar", 1005, 0, 10.0, 100.0)
    counted = checker.check(honest + [liar], local, 100.0, TARGET, local_epoch_started=99.0).records
    assert {r.instance for r in counted} == {"a", "b"}
    progress = aggregate_progress(counted, local, TARGET, 100.0)
    assert progress.epoch == 5 and progress.num_peers == 3
    with caplog.at_level(logging.WARNING, logger="swarm_opt.trust"):
        checker.check(honest + [liar], local, 106.0, TARGET, local_epoch_started=99.0)
        checker.check(honest + [liar], local, 107.0, TARGET, local_epoch_started=99.0)
    warnings = [r.getMessage() for r in caplog.records if "Ignoring peer" in r.getMessage()]
    assert len(warnings) == 1 and "claims epoch 1005 while the swarm is at 5" in warnings[0]
    # ignored: not even a live peer, until the time is up
    checked = checker.check(honest + [liar], local, 150.0, TARGET, 99.0)
    assert {r.instance for r in checked.records} == {"a", "b"} and checked.ahead == 0


def test_a_peer_one_epoch_ahead_is_live_but_not_believed_nor_counted_nor_ignored(caplog):
    """Peers that start together at load do not all see each other at once: some commit a round alone and stand one
    epoch ahead of the majority until it catches up. Honest, so never ignored (nor warned about); not believed
    either (no download from it), and its samples of the next epoch do not count in ours; but it is a live peer,
    so a round's majority is measured against it too."""
    checker = ClaimChecker(TrustConfig(ahead_grace=5.0))
    seen_epoch_begin(checker, 5, 99.0)
    local = rec("me", 5, 10, 10.0, 100.0)
    honest = [rec("a", 5, 20, 10.0, 100.0), rec("b", 5, 30, 10.0, 100.0)]
    ahead = rec("ahead", 6, 200, 10.0, 100.0)
    with caplog.at_level(logging.WARNING, logger="swarm_opt.trust"):
        for now in (100.0, 110.0, 200.0, 400.0):
            checked = checker.check(honest + [ahead], local, now, TARGET, local_epoch_started=99.0)
            assert {r.instance for r in checked.records} == {"a", "b"} and checked.ahead == 1
            progress = aggregate_progress(checked.records, local, TARGET, now, ahead=checked.ahead)
            assert progress.epoch == 5 and progress.num_peers == 4
    assert "Ignoring peer" not in caplog.text
    # two epochs ahead is no longer a round the others missed: ignored after the grace, as far ahead as epoch 1005
    two_ahead = rec("ahead", 7, 0, 10.0, 400.0)
    with caplog.at_level(logging.WARNING, logger="swarm_opt.trust"):
        checker.check(honest + [two_ahead], local, 400.0, TARGET, local_epoch_started=99.0)
        checker.check(honest + [two_ahead], local, 406.0, TARGET, local_epoch_started=99.0)
    assert "claims epoch 7 while the swarm is at 5" in caplog.text


def seen_epoch_begin(checker: ClaimChecker, epoch: int, at: float) -> None:
    """The checker saw the swarm at ``epoch - 1``, then our round moved us to ``epoch`` at ``at``."""
    checker.check([rec("a", epoch - 1, 90, 10.0, at - 1)], rec("me", epoch - 1, 90, 10.0, at - 1), at - 1, TARGET)
    checker.check([rec("a", epoch - 1, 90, 10.0, at - 1)], rec("me", epoch, 0, 0.0, at), at, TARGET, at)


def test_samples_grow_no_faster_than_a_plausible_throughput():
    config = TrustConfig(max_rate_vs_median=4.0, burst_seconds=1.0)
    checker = ClaimChecker(config)
    seen_epoch_begin(checker, 2, 100.0)
    local = rec("me", 2, 50, 10.0, 105.0)
    honest = [rec("a", 2, 50, 10.0, 105.0), rec("b", 2, 60, 12.0, 105.0)]
    # an honest peer 3x faster than the others counts in full; we saw epoch 2 begin at t=100
    fast = rec("fast", 2, 150, 30.0, 105.0)
    counted = {r.instance: r for r in checker.check(honest + [fast], local, 105.0, TARGET, 100.0).records}
    assert counted["fast"].samples == 150 and counted["a"].samples == 50
    # one claiming 70 samples/s (7x the median) is bounded to 4x the median rate, not struck
    checker = ClaimChecker(config)
    seen_epoch_begin(checker, 2, 100.0)
    greedy = rec("greedy", 2, 350, 70.0, 105.0)
    counted = {r.instance: r for r in checker.check(honest + [greedy], local, 105.0, TARGET, 100.0).records}
    assert counted["greedy"].samples == pytest.approx(4 * 10.0 * (5 + 1), abs=1)
    assert counted["greedy"].samples_per_second == pytest.approx(40.0)


def test_a_peer_claiming_absurd_samples_is_ignored_and_cannot_fill_the_batch(caplog):
    checker = ClaimChecker(TrustConfig())
    seen_epoch_begin(checker, 3, 99.0)
    local = rec("me", 3, 20, 10.0, 101.0)
    honest = [rec("a", 3, 20, 10.0, 101.0), rec("b", 3, 20, 10.0, 101.0)]
    liar = rec("liar", 3, 10**9, 1e9, 101.0)
    with caplog.at_level(logging.WARNING, logger="swarm_opt.trust"):
        counted = checker.check(honest + [liar], local, 101.0, TARGET, local_epoch_started=99.0).records
    assert {r.instance for r in counted} == {"a", "b"}
    assert not aggregate_progress(counted, local, TARGET, 101.0).ready
    assert any("claims 1000000000 samples" in r.getMessage() for r in caplog.records)
    # it stays ignored for ignore_seconds, then gets one more chance and is ignored twice as long
    assert {r.instance for r in checker.check(honest + [liar], local, 150.0, TARGET, 99.0).records} == {"a", "b"}
    checker.check(honest + [liar], local, 162.0, TARGET, 99.0)
    assert any("for 120 s" in r.getMessage() for r in caplog.records)


def test_a_liar_whose_record_trails_the_swarm_by_an_epoch_is_ignored_too(caplog):
    """A liar that copies the newest honest record every so often stands one epoch behind for most of every short
    epoch: counted as a peer that finished the last round with us, at 4x the median speed, it took most of the
    global batch and rounds fired after one step of each honest peer (the billion-samples swarm test, 24 of 64)."""
    checker = ClaimChecker(TrustConfig())
    seen_epoch_begin(checker, 3, 99.0)
    local = rec("me", 3, 8, 10.0, 100.0)
    honest = [rec("a", 3, 8, 10.0, 100.0), rec("b", 2, 20, 10.0, 99.0)]  # b finished round 2 with us
    liar = rec("liar", 2, 10**9, 1e9, 99.5)
    with caplog.at_level(logging.WARNING, logger="swarm_opt.trust"):
        counted = checker.check(honest + [liar], local, 100.0, TARGET, local_epoch_started=99.0).records
    assert {r.instance for r in counted} == {"a", "b"}
    assert any("claims 1000000000 samples" in r.getMessage() for r in caplog.records)
    share = aggregate_progress(counted, local, TARGET, 100.0, epoch_started=99.0).share
    assert share == pytest.approx(TARGET / 3)  # the honest peers share the batch among them


def test_a_slow_peer_bounds_fast_peers_but_does_not_ignore_them(caplog):
    """A peer 200x slower than the two others (their speeds measured one after the other) bounds their samples by
    its low median, but never ignores them for it: an honest peer claims at most about its share of the global
    batch, so only claims beyond twice the batch are struck (as a liar's 10^9)."""
    target = 5000
    checker = ClaimChecker(TrustConfig())
    checker.check([rec("a", 0, 0, 0.0, 99.0), rec("b", 0, 0, 0.0, 99.0)], rec("me", 0, 0, 0.0, 99.0), 99.0, target)
    seen = checker.check([rec("a", 1, 0, 0.0, 100.0), rec("b", 1, 0, 0.0, 100.0)], rec("me", 1, 0, 4.0, 100.0),
                         100.0, target, 100.0).records
    assert len(seen) == 2
    with caplog.at_level(logging.WARNING, logger="swarm_opt.trust"):
        for now in (101.0, 102.0, 103.0):  # one fast speed measured, then both
            others = [rec("a", 1, int(950 * (now - 100)), 950.0, now),
                      rec("b", 1, int(950 * (now - 100)), 950.0 if now > 101 else 0.0, now)]
            counted = checker.check(others, rec("me", 1, 4, 4.0, now), now, target, 100.0).records
            assert len(counted) == 2
    assert "Ignoring peer" not in caplog.text
    liar = checker.check([rec("liar", 1, 3 * target, 950.0, 104.0)], rec("me", 1, 4, 4.0, 104.0), 104.0, target,
                         100.0).records
    assert liar == []


def test_a_newcomer_takes_what_it_did_not_see_begin_at_face_value_up_to_one_batch():
    checker = ClaimChecker(TrustConfig())
    # an observer's first read: the epoch began before it looked, so 200 samples are plausible
    counted = checker.check([rec("a", 9, 200, 10.0, 100.0), rec("b", 9, 180, 10.0, 100.0)], None, 100.0, TARGET).records
    assert sorted(r.samples for r in counted) == [180, 200]
    # ...and they keep growing at their rate afterwards without being struck
    counted = checker.check([rec("a", 9, 230, 10.0, 103.0), rec("b", 9, 210, 10.0, 103.0)], None, 103.0, TARGET).records
    assert sorted(r.samples for r in counted) == [210, 230]


def test_a_peer_that_downloads_the_swarms_epoch_did_not_see_it_begin():
    """A newcomer at epoch 0 downloads epoch 9's state: the others have been at epoch 9 for long, so their samples
    are taken as they are (it must not ignore honest peers for samples gathered before it arrived)."""
    checker = ClaimChecker(TrustConfig())
    others = [rec("a", 9, 300, 10.0, 100.0), rec("b", 9, 250, 10.0, 100.0)]
    checker.check(others, rec("me", 0, 0, 0.0, 100.0), 100.0, TARGET)
    checker.check(others[1:], rec("me", 9, 0, 0.0, 101.0), 101.0, TARGET, local_epoch_started=101.0)  # a's record
    # was missing from one read
    counted = checker.check(others, rec("me", 9, 0, 0.0, 101.5), 101.5, TARGET, 101.0).records
    assert sorted(r.samples for r in counted) == [250, 300]


def test_newcomers_arriving_together_do_not_outvote_the_founder_they_join(caplog):
    """A founder trained alone to epoch 3; two newcomers arrive together. Neither publishes a record nor counts its
    own epoch before it holds a state: each believes epoch 3 (and downloads it), and nobody ignores the founder."""
    founder = rec("founder", 3, 40, 10.0, 100.0)
    checker = ClaimChecker(TrustConfig(ahead_grace=5.0))
    with caplog.at_level(logging.WARNING, logger="swarm_opt.trust"):
        for now in (100.0, 110.0, 120.0):
            local = rec("a", 0, 0, 0.0, now)
            counted = checker.check([founder], local, now, TARGET, local_votes=False).records
            assert aggregate_progress(counted, local, TARGET, now).epoch == 3
    assert "Ignoring peer" not in caplog.text
    # once they hold a state they vote: two founders at epoch 0 outvote a lone claim of epoch 3 (the liar case)
    checker = ClaimChecker(TrustConfig(ahead_grace=5.0))
    counted = checker.check([founder, rec("b", 0, 0, 0.0, 100.0)], rec("a", 0, 0, 0.0, 100.0), 100.0, TARGET).records
    assert {r.instance for r in counted} == {"b"}
    # a newcomer that sees nobody else is the run's founder: its own epoch counts
    assert checker.check([], rec("c", 0, 0, 0.0, 100.0), 100.0, TARGET, local_votes=False).records == []
    assert believed_epoch([0], 0) == 0


def test_trust_config_names_the_fix():
    with pytest.raises(ConfigError, match="max_rate_vs_median must be >= 1"):
        TrustConfig(max_rate_vs_median=0.5)
    with pytest.raises(ConfigError, match="ignore_seconds"):
        TrustConfig(ignore_seconds=-1)


def test_peers_whose_speed_is_not_measured_yet_are_not_struck():
    """A peer reports samples before its speed is known (its first step's interval is not a measurement): with no
    speed anywhere, nothing can be bounded by speed, and nobody is ignored for it."""
    checker = ClaimChecker(TrustConfig())
    seen_epoch_begin(checker, 1, 100.0)
    checker._reference_rate = 0.0  # the run's first epoch: no speed measured yet
    local = rec("me", 1, 8, 0.0, 101.0)
    counted = checker.check([rec("a", 1, 16, 0.0, 101.0), rec("b", 1, 8, 0.0, 101.0)], local, 101.0, TARGET,
                            100.0).records
    assert sorted(r.samples for r in counted) == [8, 16]
    counted = checker.check([rec("a", 1, 24, 10.0, 102.0), rec("b", 1, 16, 10.0, 102.0)], local, 102.0, TARGET,
                            100.0).records
    assert sorted(r.samples for r in counted) == [16, 24]


def test_a_liars_speed_is_not_believed_while_the_honest_peers_take_their_first_steps():
    """Speeds steer extrapolation and each peer's share of the global batch: before half of the peers measured
    theirs, a single claimed speed (the liar's) would be the median, and every honest share would shrink to nothing."""
    checker = ClaimChecker()
    local = rec("me", 0, 8, 0.0, 100.0)
    others = [rec("a", 0, 8, 0.0, 100.0), rec("liar", 0, 200, 1e9, 100.0)]
    counted = checker.check(others, local, 100.0, TARGET).records
    assert all(r.samples_per_second == 0 for r in counted)
    assert aggregate_progress(counted, local, TARGET, 101.0).samples_per_second == 0
    speeds = [rec("a", 0, 40, 100.0, 102.0), rec("liar", 0, 200, 1e9, 102.0)]  # now the honest speeds are known
    counted = checker.check(speeds, rec("me", 0, 40, 100.0, 102.0), 102.0, TARGET).records
    assert max(r.samples_per_second for r in counted) <= TrustConfig().max_rate_vs_median * 100.0


def test_suspensions_double_at_each_offence_and_forgive_a_peer_that_stays_clean():
    from swarm_opt.trust import Suspensions

    bans: Suspensions[str] = Suspensions(first=10.0, longest=100.0, capacity=3)
    assert bans.suspend("liar", 0.0) == 10.0
    assert bans.suspended("liar", 9.9) and not bans.suspended("liar", 10.0)
    # offending again as soon as it is back: 20, 40, 80, then capped at 100
    now, lengths = 10.0, []
    for _ in range(5):
        lengths.append(bans.suspend("liar", now))
        now += lengths[-1]
    assert lengths == [20.0, 40.0, 80.0, 100.0, 100.0]
    assert bans.offences("liar") == 6
    # one named by mistake: after its suspension and `longest` without an offence, it starts afresh
    bans.suspend("mistaken", 0.0)
    assert bans.suspend("mistaken", 10.0 + 100.0) == 10.0
    # a peer is never remembered without bound: the one whose suspension ends first goes when the table is full
    bans.suspend("a", now)
    bans.suspend("b", now + 1)
    assert sorted(bans.remembered()) == ["a", "b", "liar"]  # "mistaken" was forgiven (clean for `longest`)
    small: Suspensions[str] = Suspensions(first=10.0, longest=100.0, capacity=2)
    for t, peer in enumerate("xyz"):
        small.suspend(peer, float(t))
    assert sorted(small.remembered()) == ["y", "z"]
    # forget() drops a record whose suspension is over, never a current one
    bans.forget("b", now + 2)
    assert bans.suspended("b", now + 2)
    bans.forget("a", now + 20)
    assert bans.offences("a") == 0
    with pytest.raises(ValueError):
        Suspensions(first=0.0, longest=1.0)


def test_a_peer_ignored_for_standing_ahead_counts_again_once_it_stands_with_the_swarm(caplog):
    """After a partition heals, the side that trained on alone stands ahead until it takes the majority's state: it
    was honest, so it counts again at once, not after ``ignore_seconds``; a second claim ahead costs twice as long."""
    checker = ClaimChecker(TrustConfig(ahead_grace=5.0, ignore_seconds=60.0))
    seen_epoch_begin(checker, 100, 99.0)
    local = rec("me", 100, 10, 10.0, 100.0)
    honest = [rec("a", 100, 20, 10.0, 100.0), rec("b", 100, 30, 10.0, 100.0)]
    cut = rec("cut", 450, 0, 10.0, 100.0)  # trained on alone while the links were down
    with caplog.at_level(logging.INFO, logger="swarm_opt.trust"):
        for t in (100.0, 106.0):
            checked = checker.check(honest + [cut], local, t, TARGET, local_epoch_started=99.0)
        assert "cut" not in {r.instance for r in checked.records} and checked.ahead == 0  # ignored
        switched = rec("cut", 100, 0, 10.0, 107.0)  # it took the majority's state
        checked = checker.check(honest + [switched], local, 107.0, TARGET, local_epoch_started=99.0)
        assert {r.instance for r in checked.records} == {"a", "b", "cut"}
    lines = [r.getMessage() for r in caplog.records]
    assert any("stands with the swarm again (epoch 100)" in line for line in lines), lines
    assert any("a side of a partition that trained on alone, or a liar" in line for line in lines), lines
    # standing ahead again: ignored after the grace, for twice as long
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="swarm_opt.trust"):
        for t in (110.0, 116.0):
            checker.check(honest + [rec("cut", 999, 0, 10.0, t)], local, t, TARGET, local_epoch_started=99.0)
    assert any("for 120 s" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    # a liar still far ahead stays ignored for its whole suspension
    checked = checker.check(honest + [rec("cut", 999, 0, 10.0, 170.0)], local, 170.0, TARGET, 99.0)
    assert "cut" not in {r.instance for r in checked.records} and checked.ahead == 0


def test_a_majority_whose_records_arrive_one_by_one_after_a_partition_is_believed(caplog):
    """A healed partition's side that trained on alone (this peer and one other, at epoch 424) meets the majority's
    records (epoch 564) one at a time, each more than ``ahead_grace`` after the last, as the two sides' DHT nodes
    find each other again: each alone may be a liar and is ignored, but the second one ahead makes two signed
    identities there, and the four are believed (this peer then downloads their state) once half of them are read,
    not after the first one's suspension."""
    checker = ClaimChecker(TrustConfig(ahead_grace=10.0, ignore_seconds=60.0))
    seen_epoch_begin(checker, 424, 99.0)
    local = rec("me", 424, 10, 10.0, 100.0)
    side = [rec("m", 424, 20, 10.0, 100.0)]
    majority = [rec(name, 564, 0, 10.0, 100.0) for name in "abcd"]
    t, arrived = 100.0, []
    with caplog.at_level(logging.WARNING, logger="swarm_opt.trust"):
        for record in majority[:2]:
            arrived.append(record)
            for _ in range(3):  # reads every 5.5 s: the newest arrival outlasts its grace alone
                checked = checker.check(side + arrived, local, t, TARGET, local_epoch_started=99.0,
                                        remembered=[(b"m", "m")])
                t += 5.5
    assert any("Ignoring peer" in r.getMessage() and "epoch 564" in r.getMessage() for r in caplog.records)
    progress = aggregate_progress(checked.records, local, TARGET, t, ahead=checked.ahead)
    assert progress.epoch == 564, (checked, progress)
    assert {"a", "b"} <= {r.instance for r in checked.records}  # both counted again: they stand with the swarm
    # a lone liar far ahead, ignored, still never moves two honest peers, however long it stands there
    checker = ClaimChecker(TrustConfig(ahead_grace=10.0, ignore_seconds=60.0))
    seen_epoch_begin(checker, 5, 99.0)
    local = rec("me", 5, 10, 10.0, 100.0)
    for t in (100.0, 111.0, 122.0, 133.0):
        checked = checker.check([rec("a", 5, 20, 10.0, t), rec("liar", 1005, 0, 10.0, t)], local, t, TARGET,
                                local_epoch_started=99.0)
    assert [r.instance for r in checked.records] == ["a"] and checked.ahead == 0
    assert aggregate_progress(checked.records, local, TARGET, 133.0, ahead=checked.ahead).epoch == 5
