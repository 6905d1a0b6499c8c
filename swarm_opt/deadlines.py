"""Round deadlines that follow the swarm's measured round times (``Timeouts(adaptive=True)``, the default).

hivemind's deadlines are fixed numbers picked by hand, large enough for the slowest swarm a user expects, and a
round pays them whenever a member stops sending mid-round (it crashed, its link dropped): its groupmates wait a
third of ``averaging_timeout`` for its next part before they give the round up. Here each peer measures its own
committed rounds (``RoundTiming``: how long after it was ready and the round was due its group assembled, and how
long the all-reduce then took) and sets each round's averaging deadline from a high quantile of the recent ones,
with a wide margin, the user's ``averaging_timeout`` staying the upper bound. A round that missed its deadline (no
group, a group too small for a majority, a member that timed out) forgets the measurements: the next rounds run
under the user's bound again until enough of them committed, so that a swarm that became slow at once gets back
the time it needs at its next round, and a slowly slowing one through the quantile.

``matchmaking_time`` stays as the user set it: a group assembles as soon as every peer that will contribute
joined (``swarm_opt._hivemind.averager``), so it is only the fallback for a group that is not complete, and
shortening it was measured to cost more than it saves (hivemind's search converged in 3-4 s instead of 0.1-0.7 s
once peers declared shorter or different expirations: benchmarks/NOTEBOOK.md).

A state download's deadline (``DownloadDeadline``) moves on while the state keeps arriving: a user's
``state_download_timeout`` cannot know the state's size and the link's speed (a 100M-parameter model's state takes
~100 s at 100 Mbit/s), so it bounds the wait for a download to get going and each stall, not the transfer.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Deque, Sequence, Tuple

from swarm_opt.config import Timeouts

#: committed rounds measured before the deadline follows them, and how many recent rounds it follows
MIN_ROUNDS, WINDOW = 5, 20
QUANTILE = 0.9
#: the shortest averaging deadline ever set (seconds): below it a loaded machine's jitter alone fails rounds
MIN_AVERAGING_TIMEOUT = 10.0
#: bytes per second a state download must keep receiving for its deadline to move on: below it a donor trickling
#: its state (a liar, or a link too slow to be of use) holds the peer no longer
MIN_DOWNLOAD_RATE = 32 * 1024
#: deadline = matchmaking_time + margin x the quantile + slack: rounds may take several times their usual time
AVERAGING_MARGIN, AVERAGING_SLACK = 3.0, 2.0


@dataclass(frozen=True)
class RoundTiming:
    """What one round took, in seconds: ``waited``, from the moment this peer was ready to send and the round was
    due until its group assembled (groups that formed ahead count 0), and ``averaged``, from then until the group's
    mean was there."""

    waited: float
    averaged: float

    def __post_init__(self) -> None:
        for name in ("waited", "averaged"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"RoundTiming.{name} must be a finite number of seconds >= 0, got {value!r}")


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (not empty): a value that was measured, never interpolated."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class RoundDeadlines:
    """The deadlines of this peer's next round (``now``): ``matchmaking_time`` as given, and ``averaging_timeout``
    (the whole round, counted from the start of its search, which may begin ``matchmaking_time`` before the round is
    due; a member that sends nothing for a third of it is dropped). With ``timeouts.adaptive`` the latter follows
    the recent committed rounds (module docstring), within ``MIN_AVERAGING_TIMEOUT`` and the user's bound."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._rounds: Deque[RoundTiming] = deque(maxlen=WINDOW)
        self._lock = threading.Lock()

    def committed(self, timing: RoundTiming) -> None:
        """A round committed after ``timing``."""
        with self._lock:
            self._rounds.append(timing)

    def missed(self) -> None:
        """A round missed its deadline: back to the user's bound until ``MIN_ROUNDS`` rounds committed again."""
        with self._lock:
            self._rounds.clear()

    @property
    def averaging_timeout(self) -> float:
        bound, matchmaking = self.timeouts.averaging_timeout, self.timeouts.matchmaking_time
        with self._lock:
            rounds = list(self._rounds)
        if not self.timeouts.adaptive or len(rounds) < MIN_ROUNDS:
            return bound
        took = quantile([r.waited + r.averaged for r in rounds], QUANTILE)
        return min(bound, max(MIN_AVERAGING_TIMEOUT, matchmaking + AVERAGING_MARGIN * took + AVERAGING_SLACK))

    @property
    def now(self) -> Tuple[float, float]:
        """``(matchmaking_time, averaging_timeout)`` for the next round."""
        return self.timeouts.matchmaking_time, self.averaging_timeout


class DownloadDeadline:
    """When a state download gives up: ``timeout`` seconds after it began, moved ``window`` seconds on each time it
    is reached while the state arrived at ``MIN_DOWNLOAD_RATE`` or faster since the last move (``received``: the
    bytes received so far, a counter that only grows). ``window`` should exceed the time the downloader waits for a
    donor's next chunk before it tries another donor, so that a switch of donors does not end the download."""

    def __init__(self, timeout: float, window: float, *, now: float, received: float) -> None:
        self.at, self.window = now + timeout, window
        self._since, self._received = now, received

    def moved(self, now: float, received: float) -> bool:
        """At or after the deadline: move it on if the state still arrives fast enough, and say whether it did."""
        if now < self.at:
            return True
        if received - self._received < MIN_DOWNLOAD_RATE * max(now - self._since, 0.0):
            return False
        self.at, self._since, self._received = now + self.window, now, received
        return True
