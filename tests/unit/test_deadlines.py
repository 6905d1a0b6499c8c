"""Round deadlines that follow the measured rounds (``swarm_opt.deadlines``): the maths, without a network."""

import pytest

from swarm_opt import Timeouts
from swarm_opt.deadlines import (
    MIN_AVERAGING_TIMEOUT,
    MIN_DOWNLOAD_RATE,
    MIN_ROUNDS,
    DownloadDeadline,
    RoundDeadlines,
    RoundTiming,
    quantile,
)
from swarm_opt.errors import ConfigTypeError

FAST, SLOW = RoundTiming(waited=0.05, averaged=0.1), RoundTiming(waited=1.0, averaged=6.0)


def test_user_bound_until_enough_rounds_then_shrinks_on_fast_rounds():
    deadlines = RoundDeadlines(Timeouts(matchmaking_time=5.0, averaging_timeout=60.0))
    for _ in range(MIN_ROUNDS - 1):
        deadlines.committed(FAST)
        assert deadlines.now == (5.0, 60.0)
    deadlines.committed(FAST)
    assert deadlines.now == (5.0, MIN_AVERAGING_TIMEOUT)  # matchmaking_time as given


def test_slower_rounds_grow_the_deadline_within_the_bound():
    deadlines = RoundDeadlines(Timeouts(matchmaking_time=5.0, averaging_timeout=60.0))
    for _ in range(MIN_ROUNDS):
        deadlines.committed(FAST)
    fast = deadlines.averaging_timeout
    for _ in range(3):  # a high quantile of the last rounds: a few slow ones move it
        deadlines.committed(SLOW)
    assert deadlines.averaging_timeout >= 5.0 + 3 * 7.0 > fast  # several times the slow rounds' time
    for _ in range(20):
        deadlines.committed(RoundTiming(waited=100.0, averaged=100.0))
    assert deadlines.averaging_timeout == 60.0  # the user's number is an upper bound


def test_a_missed_deadline_goes_back_to_the_bound():
    deadlines = RoundDeadlines(Timeouts(matchmaking_time=5.0, averaging_timeout=60.0))
    for _ in range(MIN_ROUNDS):
        deadlines.committed(FAST)
    assert deadlines.averaging_timeout < 60.0
    deadlines.missed()
    assert deadlines.averaging_timeout == 60.0


def test_fixed_deadlines_and_low_bounds():
    fixed = RoundDeadlines(Timeouts(matchmaking_time=5.0, averaging_timeout=60.0, adaptive=False))
    low = RoundDeadlines(Timeouts(matchmaking_time=0.5, averaging_timeout=4.0))
    for deadlines in (fixed, low):
        for _ in range(MIN_ROUNDS):
            deadlines.committed(RoundTiming(waited=0.0, averaged=0.01))
    assert fixed.now == (5.0, 60.0)
    assert low.now == (0.5, 4.0)  # never above what the user set, even below the floor


def test_round_timing_and_quantile_inputs():
    with pytest.raises(ValueError):
        RoundTiming(waited=float("nan"), averaged=0.0)
    with pytest.raises(ValueError):
        RoundTiming(waited=-1.0, averaged=0.0)
    with pytest.raises(ConfigTypeError):
        Timeouts(adaptive="yes")
    assert quantile([3.0, 1.0, 2.0], 0.9) == 3.0
    assert quantile([float(i) for i in range(1, 21)], 0.9) == 18.0


def test_a_download_deadline_moves_on_while_the_state_arrives_fast_enough_and_only_then():
    deadline = DownloadDeadline(15.0, 23.0, now=100.0, received=5e6)  # the counter counts earlier downloads too
    assert deadline.at == 115.0
    assert deadline.moved(110.0, 5e6) and deadline.at == 115.0  # before the deadline: nothing to decide
    assert deadline.moved(115.0, 5e6 + MIN_DOWNLOAD_RATE * 15) and deadline.at == 138.0  # exactly the floor rate
    assert deadline.moved(138.0, 5e6 + MIN_DOWNLOAD_RATE * 15 + 1e8) and deadline.at == 161.0  # a fast link
    # a window below the floor rate (a donor trickling, or a stalled one): the download ends, whatever came before
    assert not deadline.moved(161.0, 5e6 + MIN_DOWNLOAD_RATE * 15 + 1e8 + MIN_DOWNLOAD_RATE * 22)
    assert deadline.at == 161.0


def test_a_download_that_receives_nothing_ends_at_its_timeout():
    deadline = DownloadDeadline(3.0, 23.0, now=0.0, received=0.0)
    assert not deadline.moved(3.0, 0.0)
    assert not deadline.moved(3.5, MIN_DOWNLOAD_RATE)  # 32 KiB in 3.5 s: below the rate
