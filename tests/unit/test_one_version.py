"""Two versions of an epoch: how a peer tells that another version outnumbers its own (``other_version``), and who
it waits for in a round (``SwarmProgress.contributors``)."""

from __future__ import annotations

from swarm_opt.progress import ProgressRecord, aggregate_progress, other_version

A, B = [1.0, 2.0, 3.0, 4.0, 5.0], [1.5, 2.0, 3.0, 4.0, 5.0]  # two parameter digests that differ


def rec(peer: bytes, epoch: int, digest=None, t: float = 100.0, samples: int = 0, sps: float = 0.0) -> ProgressRecord:
    return ProgressRecord(peer_id=peer, instance=peer.hex(), epoch=epoch, samples=samples,
                          samples_per_second=float(sps), time=float(t), client_mode=False, model_schema="s",
                          target_batch_size=100, params_digest=digest)


ME = (b"me", b"me".hex())


def test_a_larger_group_at_our_epoch_with_another_digest_outnumbers_us():
    found = other_version([rec(b"p1", 3, B), rec(b"p2", 3, B)], ME, 3, A, 1e-6, published_after=90.0)
    assert found == (3, [b"p1", b"p2"])
    assert other_version([rec(b"p1", 3, A), rec(b"p2", 3, B)], ME, 3, A, 1e-6, 90.0) is None  # we are the majority
    assert other_version([rec(b"p1", 3, None), rec(b"p2", 3, None)], ME, 3, A, 1e-6, 90.0) is None  # no digests


def test_in_a_tie_exactly_one_side_moves():
    """Two peers that trained apart, one each: the side holding the smallest peer moves nobody, the other moves."""
    low, high = (b"aa", b"aa".hex()), (b"zz", b"zz".hex())
    low_view = other_version([rec(b"zz", 2, B)], low, 2, A, 1e-6, 90.0)
    high_view = other_version([rec(b"aa", 2, A)], high, 2, B, 1e-6, 90.0)
    assert (low_view is None) != (high_view is None)
    assert (high_view or low_view)[1] in ([b"aa"], [b"zz"])


def test_a_majority_behind_us_outnumbers_us_only_once_its_records_are_newer_than_our_epoch():
    """A part of the swarm cut off trained on alone and stands ahead: the majority behind it wins, but only with
    records published after we reached our epoch (groupmates that have not published our round yet never count)."""
    behind = [rec(b"p1", 5, B, t=120.0), rec(b"p2", 5, B, t=121.0), rec(b"p3", 5, B, t=122.0)]
    assert other_version(behind, ME, 9, A, 1e-6, published_after=110.0) == (5, [b"p1", b"p2", b"p3"])
    assert other_version(behind, ME, 9, A, 1e-6, published_after=121.5) is None  # two of them are stale
    assert other_version(behind[:1], ME, 9, A, 1e-6, published_after=110.0) is None  # one of two: no majority


def test_peers_that_sit_rounds_out_are_not_contributors_but_count_as_live():
    local = rec(b"me", 4, samples=16, sps=100.0)
    others = [rec(b"h1", 4, samples=16, sps=90.0), rec(b"h2", 4, sps=110.0),  # h2: a new epoch, no sample yet
              rec(b"nan", 4)]  # every step skipped: no sample, no speed, ever
    p = aggregate_progress(others, local, target_batch_size=100, now=100.0, epoch_started=90.0)
    assert p.num_peers == 4 and p.contributors == 3


def test_recently_seen_peers_raise_the_bound_a_majority_is_measured_against():
    p = aggregate_progress([], rec(b"me", 4, samples=8, sps=10.0), target_batch_size=100, now=100.0, recent_peers=6)
    assert p.num_peers == 1 and p.recent_peers == 6 and p.max_peers == 6


def test_peers_at_an_earlier_epoch_are_counted_behind_so_that_a_finished_peer_stays_for_them():
    """The command line's ``--epochs``: a peer that reached the last epoch stays a donor while others stand behind
    it (``swarm_opt.cli.train._stay_for_stragglers``), or a peer late to the last round would train a second version
    of it alone once the others left."""
    local = rec(b"me", 100)
    late = [rec(b"p1", 100), rec(b"p2", 99, samples=32, sps=10.0)]
    assert aggregate_progress(late, local, target_batch_size=100, now=100.0).behind == 1
    assert aggregate_progress(late[:1], local, target_batch_size=100, now=100.0).behind == 0
    # a peer that stands behind the swarm counts whoever it is; this peer itself never does
    assert aggregate_progress(late, rec(b"me", 99), target_batch_size=100, now=100.0).behind == 1
