"""The host side of averaging: all-reduce a fixed list of tensors with a group of peers and serve state to them.

``TensorAverager`` owns an averager process (``swarm_opt._hivemind.engine``: a hivemind ``DecentralizedAverager``)
with shared-memory buffers shaped like the tensors it averages. A round is scheduled ahead of time (matchmaking runs
while the peer still computes), then triggered: the caller writes its values straight into the buffers and gets the
group's average back as views of them (``AveragingResult.averaged``), so nothing is copied that the caller does not
need. The result says who took part; a round that failed or produced non-finite numbers returns ``None`` and the
caller's own tensors were never touched. A group that formed for the gloo lane (``swarm_opt.gloo_lane``) averages in
the caller's process: the averager process hands it the group as it forms (``LaneCall``), so that no hand-off
between processes lies on the round's critical path.

The engine is picked here by the codec's type (``engine_for``): an elementwise codec travels inside hivemind's
all-reduce (``_Engine``), PowerSGD runs its two-phase protocol (``PowerSGDEngine``). A codec never picks its engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture, get_dht_time

from swarm_opt._hivemind.engine import (
    _START_TIMEOUT,
    BufferWriter,
    LaneCall,
    MemberInfo,
    StateProvider,
    Uploads,
    _Engine,
    _reason,
    cancel_step,
)
from swarm_opt._hivemind.fork import SharedHeap, forking_helper
from swarm_opt._hivemind.gather import (
    AGGREGATION_KEY,
    AUX_KEY,
    CELL_KEY,
    COUNTED_KEY,
    DEADLINE_KEY,
    DUE_KEY,
    LANE_KEY,
    PEERS_KEY,
    ROUND_KEY,
    STEP_PERIOD_KEY,
)
from swarm_opt._hivemind.powersgd_engine import PowerSGDEngine
from swarm_opt.aggregation import Aggregation
from swarm_opt.auth import RunAccess
from swarm_opt.buffers import AveragingResult, all_finite, buffer_like
from swarm_opt.compression import Compression, NoCompression, PowerSGD
from swarm_opt.config import Timeouts
from swarm_opt.deadlines import MIN_DOWNLOAD_RATE, DownloadDeadline, RoundDeadlines, RoundTiming
from swarm_opt.gloo_lane import Gloo, GlooLane, LaneFailure, lane_codec_dtype, lane_key

logger = logging.getLogger(__name__)


def engine_for(compression: Compression) -> Type[_Engine]:
    """The averager-process engine that runs ``compression``'s protocol: PowerSGD's two phases, or hivemind's
    all-reduce for an elementwise codec."""
    return PowerSGDEngine if isinstance(compression, PowerSGD) else _Engine


def _start_child(engine: _Engine) -> SharedHeap:
    """Fork the averager process: without the model's memory (it never reads it), sharing the heap's objects, and
    ignoring Ctrl-C (the user's process shuts it down; hivemind's ``run_in_background`` would ignore SIGINT in the
    calling process too, leaving a training script deaf to Ctrl-C). ``swarm_opt._hivemind.fork``."""
    # with the main thread, i.e. the process (not a thread that may end)
    engine.dies_with_parent = threading.current_thread() is threading.main_thread()
    with forking_helper() as heap:
        engine.start()
    return heap


class TensorAverager:
    """All-reduce tensors shaped like ``templates`` with the peers of ``prefix``; serve and download state."""

    _feedback: Any = None  # what the codec keeps between this peer's rounds (TopK's residuals), if anything

    def __init__(
        self,
        dht: DHT,
        *,
        prefix: str,
        templates: Sequence[torch.Tensor],
        timeouts: Timeouts,
        compression: Compression = NoCompression(),
        aggregation: Optional[Aggregation] = None,
        state_provider: Optional[StateProvider] = None,
        member_info: MemberInfo = dict,
        auxiliary: bool = False,
        access: Optional[RunAccess] = None,
        lane: Optional[Gloo] = None,
        target_group_size: Optional[int] = None,
    ) -> None:
        self.timeouts = timeouts
        #: each round's averaging deadline, within ``timeouts`` (``swarm_opt.deadlines``): told how rounds go
        self.deadlines = RoundDeadlines(timeouts)
        #: the matchmaking key of round ``round_id`` (hivemind's group bits: the round's line of the Moshpit grid,
        #: ``swarm_opt.groups``); '' (the default) puts every peer under one key
        self.group_key: Callable[[int], str] = lambda round_id: ""
        #: what this peer sends its groupmates along with each round, besides the round itself (e.g. a digest of its
        #: parameters); called once per round, when its matchmaking starts
        self.member_info = member_info
        self.auxiliary = auxiliary
        # a codec the lane cannot carry, or a private run without a secret, is refused before anything starts
        lane_setup = None if lane is None else (lane_codec_dtype(compression), lane_key(access))
        #: seconds between this peer's steps; groupmates wait about twice that for it to start sending
        self.step_period = 0.0
        buffers = [buffer_like(t) for t in templates]
        # a helper sends nothing of its own, so it keeps no feedback
        self._feedback = None if auxiliary else compression.feedback(buffers)
        # an elementwise codec travels inside hivemind's all-reduce; one with a protocol of its own (PowerSGD) runs in
        # its engine (``engine_for``), and gets itself as ``compression``
        self._engine: _Engine = engine_for(compression)(
            buffers, dht, start=False, prefix=prefix, min_matchmaking_time=timeouts.matchmaking_time,
            request_timeout=timeouts.request_timeout, allreduce_timeout=timeouts.averaging_timeout,
            next_chunk_timeout=timeouts.next_chunk_timeout, compression=compression,
            declare_state_period=max(2.0, timeouts.matchmaking_time), shutdown_timeout=5.0, auxiliary=auxiliary,
            allow_state_sharing=False,  # until offer_state()
            target_group_size=target_group_size,
            # parts of up to 2 MiB (hivemind: 512 KiB): fewer messages through asyncio and p2pd, 4-12 % faster
            # all-reduces of 10M-50M parameters (benchmarks/NOTEBOOK.md); about 16 parts in all below 32 MiB (a part
            # never spans two tensors: a model's small tensors add more), so that each member of a group of up
            # to 8 still reduces a share of a small model
            part_size_bytes=min(2**21, max(2**10, sum(b.numel() * b.element_size() for b in buffers) // 16)),
        )
        self._engine.state_provider = state_provider
        # resolved by the caller (``as_aggregation``); None: the codec's default (``Compression.check_aggregation``)
        self._engine.aggregation = compression.check_aggregation(None) if aggregation is None else aggregation
        self._aggregation = repr(self._engine.aggregation)  # told to the groupmates: a round needs the same everywhere
        self._mismatches_reported: set = set()
        if lane_setup is not None and not auxiliary and not self._engine.client_mode:  # before the fork
            self._engine.lane = GlooLane(lane, wire_dtype=lane_setup[0], key=lane_setup[1],
                                         timeout=timeouts.next_chunk_timeout, namespace=prefix,
                                         traffic=self._engine._traffic)
        elif lane is not None:
            logger.info("The gloo lane is off for this peer (client mode or auxiliary): it averages through hivemind")
        self._state_bytes = sum(b.numel() * b.element_size() for b in buffers)
        if access is not None:  # before the fork: the matchmaking of the averager process reads both
            self._engine.access = access
            self._engine.schema_hash = access.schema_hash(self._engine.schema_hash)
        try:
            self._shared_heap = _start_child(self._engine)
        finally:
            lane = self._engine.lane
            if lane is not None:
                lane.start() if self._engine.lane_in_host and self._engine.is_alive() else lane.release()
        try:
            self._engine.wait_until_ready(timeout=60)
        except BaseException:
            self._shared_heap.ended()
            raise
        #: announced in every round's gather: groups whose every member offers the lane average over it
        self.lane_address = None if self._engine.lane is None else self._engine.lane.address
        if self.lane_address is not None:
            logger.info(f"Offering the gloo lane at {self.lane_address} (trusted networks only: gloo neither "
                        f"authenticates nor encrypts)")
        self._scheduled: Optional[StepControl] = None
        self._scheduled_watch: Optional[MPFuture] = None  # what the averager process says of it (_Engine.watch)
        self._scheduled_round = -1
        self._scheduled_at: Tuple[float, float, float] = (0.0, 0.0, 0.0)  # its search's start, due time, safety net (s)
        self._running: Optional[StepControl] = None  # the round in all_reduce(), possibly in another thread
        self.last_failure = ""  # why the last all_reduce() returned None, in a few words
        self.last_download_failure = ""  # why the last load_state() returned None, in a few words
        self._lock = threading.Lock()

    @property
    def client_mode(self) -> bool:
        return self._engine.client_mode

    @property
    def values_reduced(self) -> int:
        """How many values this (auxiliary) peer has reduced for the others in all its rounds."""
        return int(self._engine._values_reduced.value)

    @property
    def lane_rounds(self) -> int:
        """How many of this peer's rounds averaged over the gloo lane."""
        return int(self._engine._lane_rounds.value)

    @property
    def uploads(self) -> Uploads:
        """What this peer did as a state donor (``Uploads``)."""
        engine = self._engine
        return Uploads(int(engine._uploads_most.value), int(engine._uploads_declined.value),
                       int(engine._uploads_served.value))

    @property
    def traffic(self) -> Tuple[int, int]:
        """Bytes of tensors this peer sent and received in its all-reduces so far: the parts it exchanged over
        hivemind's path, and what its gloo lane rounds moved (``gloo_lane.ring_bytes``)."""
        return self._engine._traffic.totals

    @property
    def lane_setup_seconds(self) -> float:
        """How long the last lane round took to meet its group and find (or create) the process group."""
        return float(self._engine._lane_setup.value)

    @property
    def peer_id(self) -> PeerID:
        return self._engine.peer_id

    def offer_state(self, priority: float) -> None:
        """Serve this peer's state to downloading peers from now on (a peer offers it once its state is the swarm's:
        a newcomer that has not caught up yet would hand out its own initial model), at ``priority``: newcomers ask
        the donors of highest priority first (we use the epoch)."""
        if self.client_mode or self.auxiliary:
            return
        if self._engine.state_sharing_priority != priority:
            self._engine.state_sharing_priority = float(priority)
        if not self._engine.allow_state_sharing:
            self._engine.allow_state_sharing = True

    def schedule(self, when: float, round_id: int) -> None:
        """Start matchmaking now for round ``round_id`` (the epoch it completes), due at DHT time ``when``."""
        with self._lock:
            if self._scheduled is not None and not self._scheduled.done():
                if self._scheduled_round == round_id:
                    return
                cancel_step(self._scheduled)
            due = float(when)  # a leader may assemble its group from then on, once complete (_assemble_once_complete)
            matchmaking = self.timeouts.matchmaking_time
            averaging = self._averaging_deadline()
            when = max(when, get_dht_time() + matchmaking)
            if self.auxiliary:
                # a helper only follows (see _Engine._step); a leader accepts a follower whose request says it can
                # wait at least until the leader's own deadline: say so for any leader due in the first half of
                # the search
                when = get_dht_time() + (self.timeouts.matchmaking_time + self.timeouts.averaging_timeout) / 2
            self._scheduled_round = round_id
            self._scheduled_at = (get_dht_time(), due, 2 * averaging + matchmaking)
            info = self.member_info()
            logger.debug("Round %d: looking for a group, due in %.2f s (peers seen: %s, contributing: %s)", round_id,
                         due - get_dht_time(), info.get(PEERS_KEY), info.get(COUNTED_KEY))
            self._scheduled = self._engine.step(
                scheduled_time=when, weight=0.0, timeout=averaging,
                require_trigger=True, wait=False, allow_retries=False,
                gather={**info, ROUND_KEY: round_id, STEP_PERIOD_KEY: self.step_period, DUE_KEY: due,
                        AUX_KEY: self.auxiliary, AGGREGATION_KEY: self._aggregation, CELL_KEY: self.group_key(round_id),
                        DEADLINE_KEY: float(averaging), **({LANE_KEY: self.lane_address} if self.lane_address else {})},
            )
            self._scheduled_watch = self._engine.watch(self._scheduled)

    def _averaging_deadline(self) -> float:
        """The averaging deadline of a round scheduled now: the adaptive one (``deadlines``), never shorter than a
        member's allowance to start sending at its next step (``_start_allowance``), within the user's bound."""
        return min(self.timeouts.averaging_timeout, max(
            self.deadlines.averaging_timeout, self.timeouts.matchmaking_time + _START_TIMEOUT + 4 * self.step_period))

    def round_bound(self, round_id: int) -> float:
        """The longest ``all_reduce`` of round ``round_id`` may wait if it starts now (the safety net it sets: its
        matchmaking and all-reduce deadlines, adaptive): what a machine's other ranks wait for this peer's round
        (``swarm_opt.ranks``)."""
        with self._lock:
            if self._scheduled is not None and not self._scheduled.done() and self._scheduled_round == round_id:
                return self._scheduled_at[2]
        return 2 * self._averaging_deadline() + self.timeouts.matchmaking_time

    def matched(self, round_id: int) -> bool:
        """Whether this peer's matchmaking for ``round_id``, scheduled ahead, found a group that now waits for it."""
        with self._lock:
            control = self._scheduled if self._scheduled_round == round_id else None
        return control is not None and not control.done() and control.stage == AveragingStage.AWAITING_TRIGGER

    def all_reduce(self, write: BufferWriter, weight: float, round_id: int,
                   round_is_over: Callable[[], Optional[str]] = lambda: None) -> Optional[AveragingResult]:
        """Average with a group of peers in the same round: ``write(buffers)`` puts this peer's values into the
        buffers, the result holds the group's weighted mean; ``None`` if the round failed or mixed peers of
        different rounds. While still looking for a group, the round is abandoned as soon as ``round_is_over()`` says
        why it is over for this peer (the swarm completed it without us: waiting on would only find the swarm's next
        round; or no group it could find would hold a majority)."""
        with self._engine.get_tensors() as buffers:
            write(buffers)
            # a group formed ahead for the lane sends unchecked: every member checks the sum, which a non-finite value
            # from anyone poisons, and nobody is banned for it there (hivemind's reducers would ban the sender)
            lane_ahead = self._lane_formed(round_id)
            finite = lane_ahead or all_finite(buffers)
            if finite and self._feedback is not None:
                self._feedback.select(buffers, weight, round_id)
        if not finite:
            # sit the round out instead of sending poison: a sender whose part fails mid-round gets banned by the
            # reducers, and a groupmate whose parts were reduced elsewhere could not tell it got a partial average
            logger.warning("This peer's tensors hold NaN/inf values; it sits out the averaging round")
            self.cancel_scheduled()
            return self._failed("non-finite local values")
        self.schedule(get_dht_time(), round_id)
        with self._lock:
            control, self._scheduled = self._scheduled, None
            watch, self._scheduled_watch = self._scheduled_watch, None
            self._running = control
            searched_since, due, safety_net = self._scheduled_at
        assert control is not None and watch is not None
        ready = get_dht_time()
        try:
            if not lane_ahead:  # (a lane round formed ahead needs no weight, and triggers its step once done: below)
                control.weight = float(weight)
                control.allow_allreduce()
            # a safety net only, past the averager's own bounds (finding a group within averaging_timeout of the
            # scheduling, then all-reducing within averaging_timeout): giving up earlier could abandon a round that
            # the averager completes anyway, with our values in the groupmates' average and not in ours
            deadline = time.monotonic() + safety_net
            while True:
                try:
                    what, call = watch.result(timeout=0.2)
                    break
                except concurrent.futures.TimeoutError:
                    over = round_is_over() if control.stage == AveragingStage.LOOKING_FOR_GROUP else None
                    if over:
                        raise _RoundOver(over) from None
                    if time.monotonic() > deadline:
                        raise
            finite = None  # not checked yet
            if what == "lane":
                gathered, finite = self._lane_round(call, weight)
                if lane_ahead:  # the averager process slept through the round, leaving the cores to it
                    self._engine.lane.later(control.allow_allreduce)
            else:
                gathered = control.result(timeout=max(0.0, deadline - time.monotonic()))
        except (Exception, asyncio.CancelledError) as e:  # matchmaking or all-reduce failed, or the round was
            # cancelled (hivemind's futures raise asyncio's CancelledError, a BaseException): the caller keeps its state
            logger.debug("Averaging round failed: %r", e)
            cancel_step(control)
            if not isinstance(e, (asyncio.CancelledError, _RoundOver)):  # no group in time, or a member too slow
                self.deadlines.missed()
            return self._failed(_reason(e) if not isinstance(e, asyncio.CancelledError) else "the round was cancelled")
        finally:
            with self._lock:
                self._running = None
        if not gathered:
            return self._failed("no group")
        # auxiliary members only reduced: they count in no majority, and the round they think it is does not matter
        contributors = {peer: info for peer, info in gathered.items()
                        if not (isinstance(info, dict) and info.get(AUX_KEY))}
        helpers = tuple(peer for peer in gathered if peer not in contributors)
        rounds = {info.get(ROUND_KEY) if isinstance(info, dict) else None for info in contributors.values()}
        if not self.auxiliary and rounds != {round_id}:
            # a peer that fell behind joined the swarm's next round: nobody may apply this mixture
            logger.debug("Discarding a round that mixed peers of rounds %s", rounds)
            return self._failed(f"the group mixed peers of rounds {sorted(map(str, rounds))}")
        if not contributors:
            return self._failed("a group of helpers only")
        aggregations = {info.get(AGGREGATION_KEY) if isinstance(info, dict) else None for info in gathered.values()}
        if aggregations != {self._aggregation}:
            # each member reduces its share with its own aggregation: a mixture, robust on some parts only
            others = sorted(map(str, aggregations - {self._aggregation}))
            if tuple(others) not in self._mismatches_reported:
                self._mismatches_reported.add(tuple(others))
                logger.error(f"Groupmates aggregate with {', '.join(others)}, this peer with {self._aggregation}: "
                             f"every peer of a run must pass the same aggregation=; rounds with them are discarded")
            return self._failed(f"the group mixed aggregations {others + [self._aggregation]}")
        with self._engine.get_tensors() as buffers:
            if not (all_finite(buffers) if finite is None else finite):
                logger.warning("A peer (over the gloo lane: possibly this one) sent non-finite values; the round is "
                               "discarded and retried")
                return self._failed("non-finite averaged values")
        # the buffers stay untouched until this peer triggers its next round: the caller reads them as they are
        return AveragingResult(peers=tuple(contributors), gathered=dict(gathered), averaged=tuple(buffers),
                               helpers=helpers, timing=self._timing(searched_since, ready, due))

    def _timing(self, searched_since: float, ready: float, due: float) -> Optional[RoundTiming]:
        """What the round that just ended took (``RoundTiming``), from when this peer was ready and the round due;
        None if its group's assembly was not seen (it predates the round's search)."""
        assembled, now = self._engine._assembled.value, get_dht_time()
        if not searched_since <= assembled <= now:
            return None
        start = max(ready, due)
        return RoundTiming(waited=max(0.0, assembled - start), averaged=max(0.0, now - max(assembled, ready)))

    def _lane_formed(self, round_id: int) -> bool:
        """Whether the group of round ``round_id``, scheduled ahead, formed for the lane."""
        with self._lock:
            watch = self._scheduled_watch if self._scheduled_round == round_id else None
        return watch is not None and watch.done() and watch.result()[0] == "lane"

    def _lane_round(self, call: LaneCall, weight: float) -> Tuple[Dict[PeerID, Any], bool]:
        """Average the buffers over the lane with the group of ``call``, here in the host process; tell the averager
        process's step how it went. Returns the members' gathers and whether the mean is finite (the lane checks it
        in a pass it makes anyway); raises when the round failed."""
        lane = self._engine.lane
        assert lane is not None and self._engine.lane_in_host
        try:
            with self._engine.get_tensors() as buffers:
                setup, finite = lane.all_reduce(buffers, call.peer_ids, self.peer_id.to_bytes(), call.group_id,
                                                call.addresses, weight, call.start_timeout)
        except LaneFailure as e:
            call.outcome.set_result(str(e))
            raise RuntimeError(f"gloo lane: {e}") from None
        lane.later(call.outcome.set_result, None)  # nobody waits for it: its pipe message is off the critical path
        with self._engine._lane_rounds.get_lock():
            self._engine._lane_rounds.value += 1
        self._engine._lane_setup.value = setup
        return call.gathered, finite

    def _failed(self, reason: str) -> None:
        """``all_reduce``'s result for a round that failed: ``None``, with ``reason`` kept in ``last_failure``."""
        self.last_failure = reason
        return None

    def commit(self, result: AveragingResult, round_id: int) -> None:
        """The caller applied ``result`` as round ``round_id`` (an averaged round or a round alone). Engines that keep
        state between rounds (PowerSGD's error feedback) make that round's state permanent; a round never committed
        leaves it as it was; so do codecs that keep state (TopK's residuals)."""
        self._engine.commit(result, round_id)
        if self._feedback is not None:
            self._feedback.commit(round_id, averaged=result.averaged is not None)

    def cancel_scheduled(self) -> None:
        with self._lock:
            control, self._scheduled, self._scheduled_watch = self._scheduled, None, None
        if control is not None and not control.done():
            cancel_step(control)

    def load_state(self, timeout: float, *, donors: Sequence[bytes] = (), exclude: Sequence[bytes] = (),
                   on_extend: Callable[[float], None] = lambda seconds: None
                   ) -> Optional[Tuple[Any, List[torch.Tensor], bytes]]:
        """Download (metadata, tensors, donor's peer id) from the first of ``donors`` that serves its state, or
        without donors from the best donor listed on the DHT, never from one in ``exclude``; ``None`` if none sent
        its state, with why in ``last_download_failure``. A donor may send at most 16x the averaged tensors' size,
        plus 64 MiB (optimizer state). Gives up ``timeout`` seconds after it began unless the state still arrives
        (``swarm_opt.deadlines.DownloadDeadline``); ``on_extend(seconds)`` hears each move of the deadline."""
        engine = self._engine
        try:
            future = engine.load_state_from_peers(
                wait=False, timeout=timeout, donors=[d.to_bytes() if isinstance(d, PeerID) else d for d in donors],
                exclude=exclude, max_bytes=16 * self._state_bytes + 2**26)
        except Exception as e:  # the averager process is gone
            return self._download_broke(e)
        started, before = time.monotonic(), engine.downloaded
        deadline = DownloadDeadline(timeout, self.timeouts.next_chunk_timeout + self.timeouts.request_timeout,
                                    now=started, received=before)
        while not future.done():
            at = deadline.at
            with contextlib.suppress(concurrent.futures.TimeoutError):
                future.exception(timeout=max(0.0, at - time.monotonic()))
            if future.done():
                break
            if not deadline.moved(time.monotonic(), engine.downloaded):
                future.cancel()  # the averager process stops reading at the donor's next message
                received = engine.downloaded - before
                return self._download_failed(
                    f"no donor sent its state within {timeout:.0f} s" if not received else
                    f"the state arrived slower than {MIN_DOWNLOAD_RATE // 1024} KiB/s ({received / 1e6:.3g} MB in "
                    f"{time.monotonic() - started:.3g} s)")
            if deadline.at != at:
                on_extend(deadline.window)
        try:
            downloaded = future.result()
        except Exception as e:  # the averager process or its connection broke: say how
            return self._download_broke(e)
        if downloaded is None:
            # every donor listed for this run and model was tried: none is listed, or each download failed (each
            # donor's error is logged at DEBUG)
            return self._download_failed("no peer sent its state (none listed, or each download failed: see the "
                                         "DEBUG log of swarm_opt._hivemind.engine)")
        return downloaded

    def _download_broke(self, error: Exception) -> None:
        logger.debug("State download failed: %r", error)
        return self._download_failed(f"the download failed ({type(error).__name__}: {_reason(error)})")

    def _download_failed(self, reason: str) -> None:
        """``load_state``'s result for a download that failed: ``None``, with ``reason`` kept in
        ``last_download_failure``."""
        self.last_download_failure = reason
        return None

    def shutdown(self) -> None:
        self.cancel_scheduled()
        with self._lock:
            running = self._running
        if running is not None and not running.done():
            cancel_step(running)  # an all_reduce() in another thread returns None at once
        self._engine.state_provider = None
        if self._engine.lane is not None and self._engine.lane_in_host:
            self._engine.lane.close()  # a lane round in another thread fails at once
        if self._engine.is_alive():
            self._engine.shutdown()
        self._shared_heap.ended()


class _RoundOver(RuntimeError):
    """The swarm completed the round this peer still looks for a group for (not a deadline missed)."""
