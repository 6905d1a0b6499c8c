"""A round commits on every member of its group or on none: the majority is measured against one count that every
member reads from the same gather, not against each member's own view of the swarm."""

from __future__ import annotations

from swarm_opt.buffers import AveragingResult
from swarm_opt.round import is_majority as _is_majority
from swarm_opt.round import swarm_size_seen_by as _swarm_size_seen_by


def group(*views, helpers=0, bounds=()) -> AveragingResult:
    gathered = {f"peer{i}": {"peers": v} for i, v in enumerate(views)}
    for i, bound in enumerate(bounds):
        gathered[f"peer{i}"]["bound"] = bound
    gathered.update({f"helper{i}": {"aux": True, "peers": 10**5} for i in range(helpers)})
    return AveragingResult(peers=tuple(f"peer{i}" for i in range(len(views))), gathered=gathered)


def test_members_that_saw_different_swarm_sizes_reach_the_same_verdict():
    result = group(3, 4)  # one member had not seen the newest peer yet
    verdicts = {_is_majority(result.group_size, _swarm_size_seen_by(result, own_bound)) for own_bound in (3, 4)}
    assert verdicts == {False}  # a group of 2 is no majority of 4: neither member commits
    assert _is_majority(3, _swarm_size_seen_by(group(3, 4, 4), own_bound=3))


def test_a_count_is_network_input():
    assert _swarm_size_seen_by(group(3, "many", True, -5, 10**9), own_bound=3) == 5  # only the group itself is sure
    assert _swarm_size_seen_by(group(2, 2, helpers=1), own_bound=2) == 2  # helpers count in no majority
    assert _swarm_size_seen_by(AveragingResult(peers=("a", "b"), gathered={"a": {}, "b": {}}), own_bound=3) == 3


def test_the_tightest_bound_counts_and_no_member_can_lower_the_count_below_the_others():
    """Members of a sampled swarm send their estimate and an upper bound: a newcomer's wide bound (a sample of one
    shard) does not hold back a group with a member whose view is full (exact bound), while a group of newcomers is
    measured against the tightest of their wide bounds; a member that understates its bound lowers the count only
    to the largest estimate sent."""
    assert _swarm_size_seen_by(group(3, 5, bounds=(12, 5)), own_bound=12) == 5  # a settled member's exact view
    assert not _is_majority(2, _swarm_size_seen_by(group(3, 3, bounds=(12, 10)), own_bound=12))  # two newcomers
    assert _swarm_size_seen_by(group(3, 5, bounds=(12, 1)), own_bound=12) == 5  # an understated bound
    assert _swarm_size_seen_by(group(3, 5, bounds=(12, "x")), own_bound=3) == 12
