"""The one round protocol: how the step loop runs and concludes a strategy's ``Round``.

A strategy begins a round with ``Strategy.begin_round()``. The ``Round`` it returns (``swarm_opt.strategies.base``)
knows this peer's ``weight``, ``write``\\s its values into the averaging buffers, and ends exactly once: ``apply``
(the group's mean was committed) or ``give_back`` (it was not: its values stay this peer's and are averaged next
time). A round over the strategy's live state makes ``step()`` wait for it; a round that set its values aside
(``Round.in_background``: gradient averaging with ``Overlap()``) averages in a thread of its own while training goes
on, and ``step()`` polls it. Both end in ``RoundRunner._conclude``, the single place of the commit protocol:

* an error raised inside the round (a bug: network failures make ``all_reduce`` return ``None``) gives the round
  back and is raised from ``step()``, whichever thread ran the round;
* a round that failed, or whose group holds no majority of the live peers (with Moshpit groups: of the peers its
  line of the grid is expected to hold, or counted in it if fewer, ``swarm_opt.groups``), or whose members held
  different versions of the run (``agrees``: every member decides it from the same gather), is given back;
* otherwise the round is applied, committed and reported as one step under the optimizer's state lock, so that a
  peer downloading our state never sees the new parameters with the old epoch.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch

from swarm_opt._hivemind.gather import BOUND_KEY, LINE_KEY, PEERS_KEY
from swarm_opt._hivemind.tensor_averager import TensorAverager
from swarm_opt.buffers import AveragingResult
from swarm_opt.groups import ONE_GROUP, Grid, RoundPlan, line_peers
from swarm_opt.metrics import NO_METRICS, Metrics
from swarm_opt.strategies.base import Round

logger = logging.getLogger(__name__)


_MAX_SWARM_SIZE = 1_000_000  # a count of live peers in a groupmate's gather beyond this is not believed


def is_majority(group_size: int, num_peers: int) -> bool:
    """At most one group per epoch can hold a strict majority of the live peers, so at most one version commits."""
    return 2 * group_size > num_peers or group_size >= num_peers


def swarm_size_seen_by(result: AveragingResult, own_bound: int) -> int:
    """How many live peers a round's majority is measured against: the largest count that its members saw, the
    tightest upper bound that any of them holds (``SwarmProgress.max_peers``: a sampled view's count may be low,
    its bound rarely is; a member with a full view has an exact one, and a newcomer's wide one does not then hold
    its group back), and at least the group. Each member sends both in the gather and every member computes this
    from the same gather, so a group commits on all its members or on none: measured against each member's own
    count, a member that had not seen a newcomer yet committed a group of 2 as a majority of 3 while its groupmate,
    seeing 4, discarded it, and the two then stood at different epochs for good. A member that exaggerates can only
    fail the round, which it could by not sending; one that understates its bound lowers the count no further than
    the largest count sent. ``own_bound`` serves only when no member sent a count (helpers and peers too old)."""
    counts, bounds = (_counts(result, key) for key in (PEERS_KEY, BOUND_KEY))
    if not counts and not bounds:
        return max(own_bound, result.group_size)
    return max(counts + [result.group_size] + ([min(bounds)] if bounds else []))


def line_seen_by(result: AveragingResult, plan: RoundPlan, num_peers: int) -> int:
    """How many peers a round's group must hold a majority of (``swarm_opt.groups.line_peers``), with the count of
    its line's peers that its leader sent in the gather (``LINE_KEY``; the largest if several members sent one: a
    member that exaggerates can only fail the round, which it could by not sending)."""
    counts = _counts(result, LINE_KEY)
    return line_peers(num_peers, plan, max(counts) if counts else None, result.group_size)


def _counts(result: AveragingResult, key: str) -> list:
    """The valid counts the group's members sent under ``key`` in the gather."""
    infos = [info for peer, info in result.gathered.items() if peer in result.peers and isinstance(info, dict)]
    return [v for v in (info.get(key) for info in infos) if _valid_count(v)]


def _valid_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= _MAX_SWARM_SIZE


@dataclass
class RoundInFlight:
    """A round between its start and its conclusion, with what the loop reports once it commits."""

    round: Round
    round_id: int
    num_peers: int  # at most how many live peers this peer saw when the round started (``SwarmProgress.max_peers``)
    samples: int  # this peer's samples in the round
    started: float  # monotonic
    plan: RoundPlan = ONE_GROUP  # where on the averaging grid the round averages
    result: Optional[AveragingResult] = None
    error: Optional[BaseException] = None
    thread: Optional[threading.Thread] = None

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()


class RoundRunner:
    """Runs the optimizer's rounds over ``averager``, one at a time, and concludes each by the protocol of the
    module docstring. ``on_commit(flight, result, num_peers)`` (called under ``lock`` once a round was applied and
    committed, with the swarm size its majority was measured against) moves the optimizer's epoch;
    ``await_target(round_id)`` runs before each all-reduce, in the thread that runs the round. ``agrees(result)``
    (in the training loop's thread, before a round is applied): whether the group's members held the same version
    of the run; if not, the round is given back on every member. ``grid``: this peer's place on the Moshpit grid
    (default: one group of everyone); a committed round moves it."""

    metrics: Metrics = NO_METRICS  # told how each round ended (``Optimizer.observe``)

    def __init__(self, averager: TensorAverager, *, lock: ContextManager,
                 on_commit: Callable[[RoundInFlight, AveragingResult, int], None],
                 await_target: Callable[[int], None] = lambda round_id: None,
                 agrees: Callable[[AveragingResult], bool] = lambda result: True, grid: Optional[Grid] = None) -> None:
        self._averager, self._lock, self._on_commit, self._await_target = averager, lock, on_commit, await_target
        self._agrees = agrees
        self._grid = Grid(None, 0) if grid is None else grid
        self._flight: Optional[RoundInFlight] = None

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    @property
    def samples_in_flight(self) -> Optional[int]:
        """This peer's samples in the round in flight (None when none is): all it computed toward that round's
        epoch; what it computes meanwhile is the next epoch's."""
        return None if self._flight is None else self._flight.samples

    def run(self, round: Round, *, round_id: int, num_peers: int, samples: int,
            round_is_over: Callable[[], Optional[str]], plan: RoundPlan = ONE_GROUP) -> None:
        """Run ``round``: alone if ``num_peers <= 1`` (its mean is our own values), in a thread of its own if
        ``round.in_background`` (``poll`` concludes it), otherwise here, concluding it before returning.
        ``round_is_over()``: why the round is over for this peer while it looks for a group, None while it is not
        (see ``TensorAverager.all_reduce``)."""
        assert self._flight is None, "one round at a time"
        flight = RoundInFlight(round, round_id, num_peers, samples, time.monotonic(), plan)
        if num_peers <= 1:
            flight.result = AveragingResult(peers=(self._averager.peer_id,), gathered={})
        elif round.in_background:
            self._flight = flight
            flight.thread = threading.Thread(target=self._all_reduce, args=(flight, round_is_over), daemon=True,
                                             name="swarm_opt.BackgroundRound")
            flight.thread.start()
            return
        else:
            self._all_reduce(flight, round_is_over)
        self._conclude(flight)

    def poll(self) -> None:
        """Conclude the round in flight if its all-reduce ended."""
        if self._flight is not None and self._flight.done():
            self._conclude(self._flight)

    def settle(self) -> None:
        """Wait for the round in flight and conclude it, before anything replaces the state it would update."""
        if self._flight is not None:
            if self._flight.thread is not None:
                self._flight.thread.join()
            self._conclude(self._flight)

    def abandon(self, timeout: float) -> None:
        """At shutdown (the averager stopped, so a round in flight returns at once): wait for its thread, conclude
        nothing."""
        if self._flight is not None and self._flight.thread is not None:
            self._flight.thread.join(timeout)

    def _all_reduce(self, flight: RoundInFlight, round_is_over: Callable[[], Optional[str]]) -> None:
        try:
            self._await_target(flight.round_id)
            with torch.no_grad():
                flight.result = self._averager.all_reduce(flight.round.write, flight.round.weight, flight.round_id,
                                                          round_is_over)
        except Exception as e:  # a bug (network failures return None): concluded in the training loop's thread
            flight.error = e

    def _conclude(self, flight: RoundInFlight) -> None:
        self._flight = None
        result = flight.result
        num_peers = flight.num_peers if result is None else swarm_size_seen_by(result, flight.num_peers)
        line = line_peers(num_peers, flight.plan) if result is None else line_seen_by(result, flight.plan, num_peers)
        reached = result is not None and is_majority(result.group_size, line)
        if flight.error is not None or not reached or not self._agrees(result):  # (``agrees`` says why it did not)
            if flight.error is None and not reached:
                outcome = (f"failed: {self._averager.last_failure}" if result is None
                           else f"group of {result.group_size}")
                of_line = f" in its line of the averaging grid ({num_peers} live)" if line < num_peers else ""
                logger.info(f"Round for epoch {flight.round_id} did not reach a majority of {line} "
                            f"peers{of_line} ({outcome}); keeping local progress")
            self.metrics.round_concluded("failed", time.monotonic() - flight.started, result and result.group_size or 0)
            if result is not None and not reached:  # members missed the group: the deadline may be too short
                self._averager.deadlines.missed()
            with torch.no_grad(), self._lock:
                flight.round.give_back()
            self._grid.missed(flight.plan, flight.round_id)
            if flight.error is not None:
                self._averager.cancel_scheduled()  # leave no group waiting for this peer
                raise flight.error
            return
        with torch.no_grad(), self._lock:
            flight.round.apply(result)
            self._averager.commit(result, flight.round_id)
            self._grid.moved(flight.plan, result.peers, self._averager.peer_id, flight.round_id)
            self._on_commit(flight, result, num_peers)
        if result.timing is not None:
            self._averager.deadlines.committed(result.timing)
            logger.debug("Round for epoch %d: group assembled %.2f s after it was due, averaged in %.2f s; next "
                         "deadlines %s", flight.round_id, result.timing.waited, result.timing.averaged,
                         self._averager.deadlines.now)
        self.metrics.round_concluded("committed", time.monotonic() - flight.started, result.group_size)
