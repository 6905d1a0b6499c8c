"""A round commits on every member of its group or on none: the majority is measured against one count that every
member reads from the same gather, not against each member's own view of the swarm."""

from __future__ import annotations

from swarm_opt.buffers import AveragingResult
from swarm_opt.round import is_majority as _is_majority
from swarm_opt.round import swarm_size_seen_by as _swarm_size_seen_by


def group(*views, helpers=0) -> AveragingResult:
    gathered = {f"peer{i}": {"peers": v} for i, v in enumerate(views)}
    gathered.update({f"helper{i}": {"aux": True, "peers": 10**5} for i in range(helpers)})
    return AveragingResult(peers=tuple(f"peer{i}" for i in range(len(views))), gathered=gathered)


def test_members_that_saw_different_swarm_sizes_reach_the_same_verdict():
    result = group(3, 4)  # one member had not seen the newest peer yet
    verdicts = {_is_majority(result.group_size, _swarm_size_seen_by(result, own_view)) for own_view in (3, 4)}
    assert verdicts == {False}  # a group of 2 is no majority of 4: neither member commits
    assert _is_majority(3, _swarm_size_seen_by(group(3, 4, 4), own_view=3))


def test_a_count_is_network_input():
    assert _swarm_size_seen_by(group(3, "many", True, -5, 10**9), own_view=3) == 5  # only the group itself is sure
    assert _swarm_size_seen_by(group(2, 2, helpers=1), own_view=2) == 2  # helpers count in no majority
    assert _swarm_size_seen_by(AveragingResult(peers=("a", "b"), gathered={"a": {}, "b": {}}), own_view=3) == 3
