"""The averager process's engine: hivemind's ``DecentralizedAverager``, changed where swarm_opt needs it.

``_Engine`` runs in a process of its own (forked by ``swarm_opt._hivemind.tensor_averager.TensorAverager``, the host
side): matchmaking over the run's Moshpit grid, all-or-nothing all-reduces (``swarm_opt._hivemind.allreduce``) with the
run's aggregation and audits, lane groups handed to the host (``LaneCall``), and state served to newcomers from the
host's ``state_provider``. What members tell each other as a group forms is ``swarm_opt._hivemind.gather``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import multiprocessing as mp
import random
import signal
import time
from collections import OrderedDict
from concurrent.futures import InvalidStateError
from typing import Any, AsyncIterator, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import hivemind.averaging.averager as hivemind_averager
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.compression import deserialize_torch_tensor
from hivemind.dht import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, ValueWithExpiration, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip, enter_asynchronously
from hivemind.utils.streaming import combine_from_streaming

from swarm_opt._hivemind import memtrace, state_thread
from swarm_opt._hivemind.allreduce import (
    AUDIT_SUFFIX,
    AllOrNothingRunner,
    Traffic,
    audit_evidence,
    audit_order,
    liars,
    part_owners,
    partial_failure,
)
from swarm_opt._hivemind.gather import (
    AUX_KEY,
    CELL_KEY,
    COUNTED_KEY,
    DEADLINE_KEY,
    DISTRUSTS_KEY,
    DUE_KEY,
    LINE_KEY,
    ROUND_KEY,
    STEP_PERIOD_KEY,
)
from swarm_opt._hivemind.gather import member_info as _member_info
from swarm_opt._hivemind.gather import rounds_differ as _rounds_differ
from swarm_opt._hivemind.gather import valid_cell as _valid_cell
from swarm_opt._hivemind.near_store import store_near
from swarm_opt._hivemind.tasks import hold_tasks_of_loops_made_by
from swarm_opt._libc import die_with_parent, malloc_trim, map_blocks_from
from swarm_opt.aggregation import (
    Aggregation,
    Mean,
    Reputations,
    RoundScores,
    left_out,
    reputation_of,
)
from swarm_opt.auth import RunAccess
from swarm_opt.buffers import AveragingResult
from swarm_opt.gloo_lane import GlooLane, LaneFailure, lane_addresses
from swarm_opt.trust import Suspensions

logger = logging.getLogger(__name__)

StateProvider = Callable[[], Tuple[Any, Sequence[torch.Tensor]]]
MemberInfo = Callable[[], Dict[str, Any]]
BufferWriter = Callable[[Sequence[torch.Tensor]], None]
_DHT_DRAIN_TIMEOUT = 2.0  # seconds an exiting averager process waits for the DHT process to read its last calls
_FAILURE_POLL_PERIOD = 0.05  # seconds between checks of a running all-reduce for a failed member
_GOODBYE_TIMEOUT = 5.0  # seconds to tell the groupmates that this peer left a round
_START_TIMEOUT = 3.0  # seconds a member may take to start sending, on top of twice its announced step period
_MAX_STEP_PERIOD = 600.0
_REPLY_LINGER = 10.0  # seconds a reducer's stream stays open after its last reply, unless the member closes first
_DRAIN_TIMEOUT = 5.0  # seconds a reducer's stream is drained after its handler ended (``_drain``)
_STALL_REPORT_PERIOD = 5.0  # seconds between DEBUG reports of where a round that has not ended waits
_CANCEL_GRACE = 5.0  # seconds a cancelled aggregation may take to unwind before the round is given up on
_MOST_UNHEARD = 64  # what the averager process keeps of steps whose watch has not come (it always comes)
_ASSEMBLY_POLL = 0.01  # seconds between a leader's checks whether its group is complete before its deadline
_LINE_READ_TIMEOUT = 2.0  # seconds a leader's read of its line's declarations may take
#: seconds between two reads of the group key's declarations by this peer's matchmaking (``_pace_reads``): the first
#: after a read that found something new, doubling while reads find nothing new, up to the last
_FIRST_READ_INTERVAL, _READ_INTERVAL = 0.002, 0.05
#: the averager process's heap (``_keep_heap_small``): blocks of this size or more (a round's parts, their encodings,
#: a state download's chunks) get mappings of their own, given back when freed; and the heap's free pages go back to
#: the system after a round, at most once per period
_MAPPED_FROM, _TRIM_PERIOD = 128 * 1024, 30.0
_MOST_DISTRUSTED = 64  # the most senders a member names in one gather (network input is bounded)
_SERVING_GRACE = 3.0  # seconds a leaving peer lets the means it reduced finish streaming to its groupmates
#: state downloads a donor serves at once; a newcomer beyond them gets an empty answer and asks its next donor, so
#: that many newcomers joining together spread over the donors (and come back, with backoff, if all are busy)
MAX_UPLOADS_AT_ONCE = 4
#: how long a peer named a lying reducer (``Audited``) is left out of this peer's groups the first time; each new
#: offence doubles it, up to a day (``swarm_opt.trust.Suspensions``): a peer named by mistake comes back
LIAR_BAN_SECONDS, LIAR_LONGEST_BAN_SECONDS = 600.0, 86400.0


class LaneCall(NamedTuple):
    """A group that formed for the gloo lane, as the averager process hands it to the host process, which runs the
    round itself (``_Engine.lane_in_host``): nothing crosses between the processes on the round's critical path."""

    group_id: bytes
    peer_ids: List[bytes]
    addresses: List[Tuple[str, int]]
    start_timeout: float  # seconds every member may take to begin (as hivemind's path allows them)
    gathered: Dict[PeerID, Any]  # every member's gather
    outcome: MPFuture  # the host's verdict, for the averager's step: None once averaged, else why the round failed


class Uploads(NamedTuple):
    """What a peer did as a state donor: the most downloads it served at once, how many it declined for being busy
    (each then asked another donor), how many it served to the end."""

    most: int
    declined: int
    served: int


async def _nothing(dht: DHT, node: Any) -> None:
    return None


def _let_the_dht_read_our_calls(dht: DHT) -> None:
    """Called by an averager process as it exits. Every hivemind DHT call crosses one pipe to the DHT process with a
    future whose reply pipe the DHT process fetches from the *calling* process when it reads the call; a call still
    unread when its caller exits kills the DHT process (an EOFError its read loop does not catch), and with it every
    other optimizer and the progress tracker of the peer. The DHT reads calls in order: once a last call of this
    process has returned, every earlier one was read. Bounded, and quiet if the DHT is already gone."""
    try:
        dht.run_coroutine(_nothing, return_future=True).result(timeout=_DHT_DRAIN_TIMEOUT)
    except Exception as e:  # a DHT already shut down (broken pipe) or not answering: nothing left to protect
        logger.debug("DHT did not confirm this averager's last calls: %r", e)


state_thread.install()


class _Engine(DecentralizedAverager):
    """hivemind's averager, with two changes: the state it serves to newcomers comes from the host process, and a
    round in which any part was not averaged by everyone fails instead of reporting success (hivemind silently falls
    back to local values for the parts of a peer that timed out, which would leave this peer's result different
    from its groupmates')."""

    state_provider: Optional[StateProvider] = None
    access: Optional[RunAccess] = None  # a private run's checks (set before the fork)
    aggregation: Aggregation = Mean()  # how this peer's reducer combines the parts it receives (set before the fork)
    dies_with_parent = False  # set before the fork by a host that forks from its main thread
    lane: Optional[GlooLane] = None  # the gloo fast lane, if this peer offers it (set before the fork)
    #: where lane rounds run: in the host process, which wrote the round's tensors (the averager process only forms
    #: the group and hands it over: ``LaneCall``); PowerSGD's engine computes its factors in the averager process and
    #: runs its lane rounds there
    lane_in_host = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._goodbyes: set = set()  # goodbye tasks in flight (the averager process keeps them referenced)
        self._values_reduced = mp.Value("d", 0.0)  # an auxiliary peer's share of every round, summed (shared)
        self._serving = 0  # reducer streams in flight (averager process)
        self._lane_rounds = mp.Value("i", 0)  # rounds this peer averaged over the gloo lane (shared)
        self._lane_setup = mp.Value("d", 0.0)  # seconds the last lane round took to set up (shared)
        self._uploads = 0  # state downloads this donor serves now (averager process)
        self._uploads_most = mp.Value("i", 0)  # the most it served at once (shared)
        self._uploads_declined = mp.Value("i", 0)  # downloads it sent to other donors, being busy (shared)
        self._uploads_served = mp.Value("i", 0)  # downloads it served to the end (shared)
        self._downloaded = mp.Value("d", 0.0)  # bytes of state received from donors, ever (shared)
        self._traffic = Traffic()  # bytes of tensor parts sent and received in all-reduces (shared)
        #: peers an audited round showed lying as reducers, left out of groups for a while (averager process)
        self._liars: Suspensions[PeerID] = Suspensions(LIAR_BAN_SECONDS, LIAR_LONGEST_BAN_SECONDS)
        self._reputations: Optional[Reputations] = None  # Reputation: this reducer's memory (averager process)
        self._left_out_seen: set = set()  # senders whose leaving out was logged (averager process)
        self._helpers_seen = 0  # auxiliary members of this peer's last group (averager process)
        #: groups a step's matchmaking assembled that have not begun to average yet, by step (averager process)
        self._unstarted: Dict[StepControl, Any] = {}
        #: the host's futures that say how each step goes on (``watch``), by step; and what was to be said of a step
        #: before its future arrived (averager process)
        self._watches: Dict[int, MPFuture] = {}
        self._unheard: OrderedDict[int, Tuple[Tuple[str, Any], bool]] = OrderedDict()
        self._host_lanes: Dict[bytes, MPFuture] = {}  # the verdicts of lane rounds the host runs, by group id
        self._assembled = mp.Value("d", 0.0)  # DHT time at which this peer's last group assembled (shared)
        self._next_trim = 0.0  # when ``_keep_heap_small`` may trim the heap again (averager process)
        self._tracer: Optional[memtrace.Tracer] = None  # SWARM_OPT_TRACEMALLOC's sampler (averager process)
        #: the all-reduce deadline this engine was made with: each round's own (``DEADLINE_KEY``) stays within it
        self._bound_allreduce = kwargs.get("allreduce_timeout")

    def shutdown(self) -> None:  # the host process
        alive = self.is_alive()
        super().shutdown()
        if alive:  # hivemind told the state-serving thread to end: it must not outlive the interpreter's exit
            state_thread.join(self, self.shutdown_timeout)

    def run(self) -> None:  # the averager process
        if self.dies_with_parent:  # a host SIGKILLed alone must not leave this process behind, an orphan
            die_with_parent(signal.SIGKILL, self._parent_pid)
        if self.lane is not None:
            self.lane.release() if self.lane_in_host else self.lane.start()
        _write_near(self.dht)
        hold_tasks_of_loops_made_by(hivemind_averager)
        map_blocks_from(_MAPPED_FROM)
        self._tracer = memtrace.start_if_asked(self._memory_counters())
        try:
            super().run()
        finally:
            _let_the_dht_read_our_calls(self.dht)

    def _memory_counters(self) -> Dict[str, Callable[[], Any]]:
        """What ``memtrace`` counts in this averager process: every structure that could grow with rounds or peers."""
        control = lambda: self._p2p._client.control  # noqa: E731
        matchmaking = lambda: self._matchmaking  # noqa: E731
        return {
            "running_groups": lambda: self._running_groups, "unstarted": lambda: self._unstarted,
            "watches": lambda: self._watches, "unheard": lambda: self._unheard, "host_lanes": lambda: self._host_lanes,
            "goodbyes": lambda: self._goodbyes, "left_out_seen": lambda: self._left_out_seen,
            "liars": lambda: self._liars._entries, "mpfutures": lambda: MPFuture._active_futures or {},
            "p2p_pending_calls": lambda: control()._pending_calls,
            "p2p_handler_tasks": lambda: control()._handler_tasks, "p2p_stream_handlers": lambda: control().handlers,
            "p2p_pending_messages": lambda: control()._pending_messages.qsize(),
            "followers": lambda: matchmaking().current_followers,
            "leader_queue": lambda: matchmaking().potential_leaders.leader_queue,
            "past_attempts": lambda: matchmaking().potential_leaders.past_attempts,
        }

    async def _step(self, *, step: StepControl, future_for_init: Any) -> None:  # runs in the averager process
        if self._tracer is not None:
            self._tracer.watch_loop(asyncio.get_running_loop())
        # the round's line of the Moshpit grid (swarm_opt.groups) is its matchmaking key; '' for one group
        info = _member_info(self.serializer, step.data_for_gather)
        cell = info.get(CELL_KEY, "")
        self._matchmaking.group_key_manager.group_bits = cell if _valid_cell(cell) else ""
        if self.mode == AveragingMode.AUX:
            # a helper only follows: it never declares itself a leader (nor accepts followers), so it can neither
            # split the trainers into two groups nor hold them until its own deadline; it joins a trainer's group
            self._matchmaking.client_mode = True
        if self._liars.remembered() and not getattr(self._matchmaking, "_avoids_liars", False):
            self._avoid_liars_as_leaders(self._matchmaking)
        if not getattr(self._matchmaking, "_adjusted", False):  # hivemind makes it once, in the averager process
            _pace_reads(self._matchmaking)
            self._remember_groups(self._matchmaking)
            self._matchmaking._adjusted = True
        _renew_finished_search(self._matchmaking)
        self._apply_deadline(info.get(DEADLINE_KEY))
        self._tell_distrusted(step)
        helpers = []
        if self.mode != AveragingMode.AUX and self._matchmaking.target_group_size is None:
            helpers.append(asyncio.ensure_future(self._assemble_once_complete(step, info)))
        if self.mode != AveragingMode.AUX and self._matchmaking.group_key_manager.group_bits:
            helpers.append(asyncio.ensure_future(self._count_line(step)))
        try:
            await super()._step(step=step, future_for_init=future_for_init)
        finally:
            for helper in helpers:
                helper.cancel()
            unstarted = self._unstarted.pop(step, None)
            # matched, then cancelled or failed before sending anything (a lane round has its own start timeout)
            if unstarted is not None and self._lane_addresses(unstarted) is None:
                self._say_goodbye(unstarted)
            if unstarted is not None:
                self._host_lanes.pop(unstarted.group_id, None)
            self._tell_host(step, "done", None)
            self._keep_heap_small()

    def _keep_heap_small(self) -> None:
        """After a round, at most every ``_TRIM_PERIOD`` seconds: give the heap's free pages back to the system.
        glibc keeps what a process freed in its heaps, and rounds that fail as a peer dies (its streams cut mid-part,
        its state download abandoned) leave free holes that later rounds do not fill: measured (``benchmarks/soak.py
        --diagnose``), the averager process's heap grew by about 1 MB per SIGKILLed groupmate, most of it free."""
        now = time.monotonic()
        if now >= self._next_trim:
            self._next_trim = now + _TRIM_PERIOD
            malloc_trim()

    def _apply_deadline(self, deadline: Any) -> None:
        """This round's averaging deadline, sent by the host with the round (``swarm_opt.deadlines``), within the
        one this engine was made with: the all-reduce's timeout, and a third of it for a silent sender (hivemind's
        ``next_chunk_timeout``; a silent reducer gets twice that)."""
        allreduce = self._bound_allreduce
        if allreduce is None:
            return
        if isinstance(deadline, float) and math.isfinite(deadline) and deadline > 0:
            allreduce = min(allreduce, deadline)
        self._allreduce_timeout = allreduce
        self.allreduce_kwargs.update(sender_timeout=allreduce / 3, reducer_timeout=2 * allreduce / 3)

    # --- what the host hears of a step: ("lane", LaneCall) when it runs the round, then ("done", None) ---------------
    def watch(self, step: StepControl) -> MPFuture:  # host process
        """A future that the averager process sets once the host has something to do for ``step``: ``("lane",
        LaneCall)``, the group formed for the lane (run the round, then set the call's ``outcome``), or ``("done",
        None)``, the step ended (its result is ready)."""
        future = MPFuture()
        self._outer_pipe.send(("_watch", [_step_key(step), future], {}))
        return future

    async def _watch(self, key: int, future: MPFuture) -> None:
        unheard = self._unheard.pop(key, None)
        if unheard is not None:
            news, done = unheard
            future.set_result(news)
            if done:
                return
        self._watches[key] = future  # until the step is done

    def _tell_host(self, step: StepControl, what: str, call: Optional[LaneCall]) -> None:
        """Tell the host what became of ``step``: the first news reaches it, ``"done"`` ends the step's watch."""
        key, done = _step_key(step), what == "done"
        future = self._watches.pop(key, None) if done else self._watches.get(key)
        if future is not None:
            if not future.done():
                future.set_result((what, call))
            return
        # the step's watch is still on its way from the host: keep the first news, and whether the step is done
        news, was_done = self._unheard.pop(key, ((what, call), False))
        self._unheard[key] = (news, was_done or done)
        while len(self._unheard) > _MOST_UNHEARD:
            self._unheard.popitem(last=False)

    def _remember_groups(self, matchmaking: Any) -> None:
        """Keep the group each step's matchmaking assembled until it begins to average (``_aggregate_with_group``).
        A step matched ahead of its round waits for the host's trigger; a host that cancels it then (it caught up with
        the swarm instead) left its groupmates waiting for parts it would never send, until their start timeout: the
        step now says goodbye to them on its way out (``_step``)."""
        look_for_group = matchmaking.look_for_group

        async def remembered(step: StepControl) -> Any:
            group_info = await look_for_group(step)
            if group_info is not None:
                self._assembled.value = get_dht_time()
                self._unstarted[step] = group_info
                addresses = self._lane_addresses(group_info)
                if addresses is not None and self.lane_in_host:
                    self._hand_lane_to_host(step, group_info, addresses)
            return group_info

        matchmaking.look_for_group = remembered

    async def _assemble_once_complete(self, step: StepControl, info: dict) -> None:
        """As a leader in a round of one group, assemble the group as soon as every live peer that this peer's
        tracker counted (``COUNTED_KEY`` of its gather) has joined, this peer is ready to send (triggered) and the
        round is due; not at the leader's deadline, which hivemind sets at least ``matchmaking_time`` after the search
        began, a floor under every round shorter than that. Helpers publish no progress: as many are awaited as were
        in this peer's last group (a helper that missed a round searches on and is in the next leader's group early).
        An overcount (a peer or helper that left, a peer behind) falls back to the deadline; a peer the count missed
        (a newcomer seen by nobody yet) finds the group formed and joins the next round. A peer whose view is a
        sample of sharded records sends no count (a sample can miss the same live peer round after round:
        ``docs/hivemind.md``), and Moshpit groups assemble once full (hivemind's
        ``target_group_size``): both at the deadline."""
        expected, due = info.get(COUNTED_KEY), info.get(DUE_KEY)
        if type(expected) is not int or expected < 2 or not isinstance(due, float):
            return
        matchmaking = self._matchmaking
        logger.debug("Round %s: a group leader assembles once %d trainers joined (due in %.2f s, deadline in %.2f s)",
                     info.get(ROUND_KEY), expected, due - get_dht_time(), step.scheduled_time - get_dht_time())
        while not step.done():
            await asyncio.sleep(_ASSEMBLY_POLL)
            if not (step.triggered and get_dht_time() >= due and self._group_complete(step, expected)):
                continue
            async with matchmaking.lock_request_join_group:
                if self._group_complete(step, expected):  # still leading this step's search, nobody left
                    logger.debug("Round %s: all %d trainers counted joined, %.2f s after it was due",
                                 info.get(ROUND_KEY), expected, get_dht_time() - due)
                    await matchmaking.leader_assemble_group()
                    return

    async def _count_line(self, step: StepControl) -> None:
        """As a leader on a line of the Moshpit grid, shortly before the group is due: count the peers declared under
        the line's matchmaking key this round (still looking or already grouped) and name the count in this peer's
        gather (``LINE_KEY``), which every member receives at assembly. A line holds a random number of peers; one
        short of its expected share can then still commit a group holding a majority of the peers it does hold
        (``swarm_opt.round.line_seen_by``). A group assembled before the count, or a read that failed, names none."""
        matchmaking = self._matchmaking
        lead = matchmaking.min_matchmaking_time / 3  # the line's members declared when their search began
        await asyncio.sleep(max(0.0, step.scheduled_time - lead - get_dht_time()))
        if not (matchmaking.step_control is step and matchmaking.current_followers
                and not matchmaking.assembled_group.done()):
            return  # not leading a group (yet): a follower's count would not be the group's
        key = matchmaking.group_key_manager.current_key
        try:
            found = await asyncio.wait_for(self.dht.get(key, latest=True, return_future=True), _LINE_READ_TIMEOUT)
        except Exception as e:  # no count: the group is held to its line's expected share
            logger.debug("Reading the declarations of line %s failed: %r", key, e)
            return
        declared = set(found.value) if found is not None and isinstance(found.value, dict) else set()
        count = len(declared | {self.peer_id.to_bytes()} | {peer.to_bytes() for peer in matchmaking.current_followers})
        if matchmaking.step_control is step and not matchmaking.assembled_group.done():
            logger.debug("Line %s: %d peer(s) declared this round", key, count)
            self._tell_group(step, LINE_KEY, count)

    def _group_complete(self, step: StepControl, expected: int) -> bool:
        """Whether this peer leads ``step``'s search, not yet assembled, with ``expected`` trainers (itself included)
        and the helpers of its last group."""
        matchmaking = self._matchmaking
        if not (matchmaking.is_looking_for_group and matchmaking.step_control is step and not matchmaking.client_mode
                and matchmaking.current_leader is None and not matchmaking.assembled_group.done()):
            return False
        helpers = sum(bool(_member_info(self.serializer, request.gather).get(AUX_KEY))
                      for request in matchmaking.current_followers.values())
        trainers = len(matchmaking.current_followers) - helpers
        return 1 + trainers >= expected and helpers >= self._helpers_seen

    def _reputation_memory(self) -> Optional[Reputations]:
        """This reducer's memory of senders, with ``Reputation`` (made in the averager process, where it reduces)."""
        reputation = reputation_of(self.aggregation)
        if reputation is not None and self._reputations is None:
            self._reputations = Reputations(reputation)
        return self._reputations

    def _tell_distrusted(self, step: StepControl) -> None:
        """``Reputation``: name in this round's gather the senders this reducer distrusts (``left_out``)."""
        memory = self._reputation_memory()
        if memory is None:
            return
        self._tell_group(step, DISTRUSTS_KEY, [str(peer) for peer in memory.distrusted()[:_MOST_DISTRUSTED]])

    def _tell_group(self, step: StepControl, key: str, value: Any) -> None:
        """Add ``key: value`` to what this peer sends along in ``step``'s matchmaking gather."""
        bandwidth, mode, user = self.serializer.loads(step.data_for_gather)
        info = self.serializer.loads(user)
        info[key] = value
        step._data_for_gather = self.serializer.dumps([bandwidth, mode, self.serializer.dumps(info)])

    def _left_out(self, group_info: Any) -> set:
        """``Reputation``: the members that more than half of the group name in the gather, the same on every
        member (every member receives the same gather); one log line per sender, the first time."""
        if reputation_of(self.aggregation) is None:
            return set()
        votes = []
        for data in group_info.gathered:
            named = _member_info(self.serializer, data).get(DISTRUSTS_KEY)
            valid = isinstance(named, list) and len(named) <= _MOST_DISTRUSTED
            votes.append([name for name in named if isinstance(name, str)] if valid else [])
        names = left_out([str(peer) for peer in group_info.peer_ids], votes)
        for name in names - self._left_out_seen:
            logger.warning(f"Peer {name} is left out of this group's reduction: more than half of the group "
                           f"distrusts its values (Reputation)")
        self._left_out_seen |= names
        return {peer for peer in group_info.peer_ids if str(peer) in names}

    def _avoid_liars_as_leaders(self, matchmaking: Any) -> None:
        """A follower does not ask a known liar (``Audited``) to lead its group: it goes on to the next leader."""
        request = matchmaking._request_join_group

        async def _request_join_group(leader: PeerID) -> Any:
            return None if self._liars.suspended(leader, time.monotonic()) else await request(leader)

        matchmaking._request_join_group, matchmaking._avoids_liars = _request_join_group, True

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's, refusing a known liar (``Audited``): its groups form without it; and a follower that looks for
        a group of another round than ours (one of us has not seen the swarm's last commit yet): every member would
        discard that group's result, so it looks on for a group of its own round."""
        if self._liars.suspended(context.remote_id, time.monotonic()):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        if _rounds_differ(self.serializer, request.gather, self._matchmaking.step_control):
            logger.debug("Refused %s as a follower: it looks for a group of round %s, this peer of round %s",
                         context.remote_id, _member_info(self.serializer, request.gather).get(ROUND_KEY),
                         _member_info(self.serializer, self._matchmaking.step_control.data_for_gather).get(ROUND_KEY))
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_KEY)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):  # runs in the averager process
        """hivemind's aggregation, abandoned as soon as any of its all-reduces registers a failure (a round that lost
        a member fails as a whole anyway, see ``_check_complete``). A peer that leaves a round tells its groupmates,
        so that none of them waits out a timeout for streams that will never come. A group whose every member
        offers the gloo lane averages there instead (``_lane_round``)."""
        self._unstarted = {step: group for step, group in self._unstarted.items() if group is not group_info}
        self._helpers_seen = sum(bool(_member_info(self.serializer, data).get(AUX_KEY)) for data in group_info.gathered)
        known_liars = [peer for peer in group_info.peer_ids if self._liars.suspended(peer, time.monotonic())]
        if known_liars:  # a group formed around a liar by a groupmate that does not know it yet
            self._say_goodbye(group_info)
            raise AllreduceException(f"the group holds {', '.join(map(str, known_liars))}, seen lying as a reducer")
        addresses = self._lane_addresses(group_info)
        if addresses is not None:
            infos = [_member_info(self.serializer, data) for data in group_info.gathered]
            return await self._lane_round(group_info, addresses, infos, **kwargs)
        aggregation = asyncio.ensure_future(super()._aggregate_with_group(group_info, min_vector_size, **kwargs))
        watchdog = asyncio.ensure_future(self._first_failure(group_info))
        try:
            await asyncio.wait({aggregation, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if not aggregation.done():
                raise AllreduceException(watchdog.result())
            gathered = aggregation.result()
            self._check_complete(group_info.group_id)
            return gathered
        except BaseException:
            self._say_goodbye(group_info)
            raise
        finally:
            await cancel_within(_CANCEL_GRACE, watchdog, aggregation)

    def _lane_addresses(self, group_info: Any) -> Optional[List[Tuple[str, int]]]:
        """Where the group's members listen for the gloo lane, if this peer and every member offer it."""
        if self.lane is None:
            return None
        return lane_addresses([_member_info(self.serializer, data) for data in group_info.gathered])

    def _hand_lane_to_host(self, step: StepControl, group_info: Any, addresses: List[Tuple[str, int]]) -> None:
        """Tell the host the group it will average with over the lane, as soon as the group formed: a step matched
        ahead of its round finds the call waiting when the host triggers it."""
        infos = [_member_info(self.serializer, data) for data in group_info.gathered]
        outcome = MPFuture()
        self._host_lanes[group_info.group_id] = outcome
        self._tell_host(step, "lane", LaneCall(
            group_id=group_info.group_id, peer_ids=[peer.to_bytes() for peer in group_info.peer_ids],
            addresses=addresses, start_timeout=_start_allowance(info.get(STEP_PERIOD_KEY) for info in infos),
            gathered=self._gathered(group_info), outcome=outcome))

    def _gathered(self, group_info: Any) -> dict:
        """Every member's gather, by peer: what a round's step returns."""
        return {peer: self.serializer.loads(self.serializer.loads(data)[2])
                for peer, data in zip(group_info.peer_ids, group_info.gathered)}

    async def _lane_round(self, group_info: Any, addresses: List[Tuple[str, int]], infos: List[dict],
                          **kwargs: Any) -> dict:
        """The round over the gloo lane: every member chose it from the same gather, so nobody takes hivemind's path.
        Members get as long to begin as ``_first_failure`` gives them on hivemind's path. With the lane in the host,
        the host runs the round (``LaneCall``) and this step waits for its verdict; otherwise the all-reduces of the
        round (PowerSGD runs two) go through ``_run_allreduce_inplace_`` as on hivemind's path, with ``lane=``."""
        if self.lane_in_host:
            outcome = self._host_lanes.pop(group_info.group_id)
            self._running_groups[group_info.group_id].set_result(
                _LaneRound(self.lane, [peer.to_bytes() for peer in group_info.peer_ids]))
            failure = await outcome
            if failure is not None:
                raise AllreduceException(f"gloo lane: {failure}")
            return self._gathered(group_info)
        start_timeout = _start_allowance(info.get(STEP_PERIOD_KEY) for info in infos)
        async with self._tensors_now() as tensors:
            await self._run_allreduce_inplace_(tensors, group_info, lane=(addresses, start_timeout), **kwargs)
        with self._lane_rounds.get_lock():
            self._lane_rounds.value += 1
        return self._gathered(group_info)

    @contextlib.asynccontextmanager
    async def _tensors_now(self) -> AsyncIterator[Sequence[torch.Tensor]]:
        """``get_tensors()`` for the event loop: taken at once when free (it is when a round begins: the host let go of
        it before triggering), else waited for in a thread as hivemind does; a hop to a thread costs a lane round
        about a millisecond on the critical path, more on a loaded machine."""
        if self.lock_averaged_tensors.acquire(block=False):
            try:
                yield self._averaged_tensors
            finally:
                self.lock_averaged_tensors.release()
        else:
            async with enter_asynchronously(self.get_tensors()) as tensors:
                yield tensors

    async def _lane_allreduce(self, tensors: Sequence[torch.Tensor], group_info: Any, group_id: bytes,
                              addresses: List[Tuple[str, int]], start_timeout: float, weight: float) -> None:
        """One all-reduce of a lane round, in the lane's thread, registered as ``group_id``."""
        assert self.lane is not None
        peer_ids = [peer.to_bytes() for peer in group_info.peer_ids]
        self._running_groups[group_id].set_result(_LaneRound(self.lane, peer_ids))
        future = self.lane.submit(tensors, peer_ids, self.peer_id.to_bytes(), group_id, addresses, weight,
                                  start_timeout)
        try:
            # (a non-finite mean fails no lane round here: the host checks the buffers the round left, as on
            # hivemind's path)
            self._lane_setup.value, _ = await asyncio.wrap_future(future)
        except LaneFailure as e:
            raise AllreduceException(f"gloo lane: {e}") from None
        except asyncio.CancelledError:
            # the buffers stay locked until the lane's thread lets go of them: abort its process group
            self.lane.drop(peer_ids)
            await asyncio.wait({asyncio.wrap_future(future)}, timeout=_GOODBYE_TIMEOUT)
            raise

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: Any) -> Iterator[None]:
        """hivemind's, registering the second all-reduce of an audited round as well (before the group is signalled:
        a groupmate may start sending to it first)."""
        audit = group_info.group_id + AUDIT_SUFFIX if self.aggregation.reducers_per_part == 2 else None
        if audit is not None:
            self._running_groups[audit] = asyncio.Future()
        try:
            with super()._register_allreduce_group(group_info):
                yield
        finally:
            if audit is not None:
                future = self._running_groups.pop(audit, None)
                if future is not None and not future.done():
                    future.cancel()

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any,
                                      group_id: Optional[bytes] = None, *,
                                      lane: Optional[Tuple[List[Tuple[str, int]], float]] = None,
                                      **kwargs: Any) -> None:
        """hivemind's, with all-or-nothing reducers that return means (``swarm_opt._hivemind.allreduce``): the buffers
        receive, part by part, the group's mean, identical on every member. ``Audited``: two all-reduces, compared.
        In a lane round (``lane``: the members' addresses and how long they may take to begin) the lane computes the
        same mean instead."""
        group_id = group_info.group_id if group_id is None else group_id
        if lane is not None:
            await self._lane_allreduce(tensors, group_info, group_id, *lane, weight=float(kwargs["weight"]))
            return
        # the members' modes: hivemind computes them and forgets to pass them on (its PR #432), so its auxiliary
        # peers act as senders of zero-weight tensors; ours only reduce
        modes = tuple(AveragingMode(self.serializer.loads(data)[1]) for data in group_info.gathered)
        # a member starts sending at its next step: hivemind's reducers would ban it after next_chunk_timeout
        kwargs["start_timeout"] = _start_allowance(_member_info(self.serializer, data).get(STEP_PERIOD_KEY)
                                                   for data in group_info.gathered)
        kwargs["left_out"] = self._left_out(group_info)
        kwargs["traffic"] = self._traffic
        runner = AllOrNothingRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                                    group_id=group_id, ordered_peer_ids=group_info.peer_ids, modes=modes,
                                    aggregation=self.aggregation, **kwargs)
        audit = audit_order(group_info.peer_ids, runner.tensor_part_container.num_parts_by_peer) \
            if self.aggregation.reducers_per_part == 2 else None
        assert group_id in self._running_groups, "hivemind registers the group before it runs an all-reduce"
        self._running_groups[group_id].set_result(runner)
        runners = [runner]
        if self.aggregation.reducers_per_part == 2:
            runners.append(await self._audited_allreduce(runner, tensors, group_info, modes, audit, **kwargs))
        else:
            await self._consume(runner, tensors)
        memory = self._reputation_memory()
        if memory is not None:  # a completed round: what this reducer saw of each sender
            scores = RoundScores()
            for each in runners:
                scores.add_all(each.tensor_part_reducer.scores, [str(peer) for peer in each.sender_peer_ids])
            means = scores.means()
            memory.record(means)
            logger.debug("Reputation: this round's scores %s; distrusted %s", means, memory.distrusted())
        if self.mode == AveragingMode.AUX:
            with self._values_reduced.get_lock():  # what this helper took off the trainers (shared with the host)
                self._values_reduced.value += sum(shape.numel() for shape in runner.tensor_part_reducer.part_shapes)

    async def _consume(self, runner: AllOrNothingRunner, tensors: Sequence[torch.Tensor]) -> None:
        """Run ``runner`` to its end, copying the means into ``tensors`` (an auxiliary peer receives none)."""
        if self.mode == AveragingMode.AUX:
            async for _ in runner:
                raise AllreduceException("an auxiliary peer received averaged values it never sent")
            return
        async for tensor, mean in azip(as_aiter(*tensors), runner):
            tensor.copy_(mean)  # the same values on every member (the runner returns means, not differences)

    async def _audited_allreduce(self, runner: AllOrNothingRunner, tensors: Sequence[torch.Tensor], group_info: Any,
                                 modes: Sequence[AveragingMode], order: Optional[List[PeerID]], **kwargs: Any
                                 ) -> AllOrNothingRunner:
        """``runner``'s all-reduce and a second one of the same values with every share reduced by another member
        (``order``: ``swarm_opt._hivemind.allreduce.audit_order``), at the same time; the round fails if any part's
        two results differ (``Audited``). Every member computes the same order from the same group, so all of them
        run both. Returns the second runner."""
        audit_id = group_info.group_id + AUDIT_SUFFIX
        if order is None:
            self._running_groups[audit_id].cancel()
            raise AllreduceException("Audited: only one member of the group reduces, nobody can check it")
        copies = [t.clone() for t in tensors]  # taken before the first all-reduce writes its means into tensors
        audit = AllOrNothingRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=copies,
                                   group_id=audit_id, ordered_peer_ids=order,
                                   modes=tuple(modes[group_info.peer_ids.index(peer)] for peer in order),
                                   aggregation=self.aggregation, **kwargs)
        self._running_groups[audit_id].set_result(audit)
        owners = part_owners(runner)
        tasks = [asyncio.ensure_future(self._consume(runner, tensors)),
                 asyncio.ensure_future(self._consume(audit, copies))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.mode == AveragingMode.AUX:  # a helper receives no results: it has nothing to compare
            self._check_complete(audit_id)
            return audit
        # (audit_evidence fails the round if either all-reduce is partial, before comparing them)
        pairs = await asyncio.get_event_loop().run_in_executor(
            None, audit_evidence, self.aggregation, [runner, audit], owners, tensors, copies, group_info.peer_ids,
            order)
        if pairs:
            now = time.monotonic()
            for liar in liars(pairs):
                if not self._liars.suspended(liar, now):
                    seconds = self._liars.suspend(liar, now)
                    logger.warning(f"Peer {liar} returned means that two other reducers of the same values "
                                   f"contradict: it lies (or is broken); left out of groups for {seconds:.0f} s "
                                   f"(offence {self._liars.offences(liar)}; each new one doubles it)")
            named = "; ".join(sorted(f"{a} and {b}" for a, b in pairs))
            raise AllreduceException(f"Audited: reducers returned different means of the same values ({named}): "
                                     f"one of each pair lies")
        return audit

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, counted: this peer's own round can end (all its parts averaged) while the means it reduced are
        still streaming to its groupmates; a peer that leaves right then waits for them (see ``_shutdown``)."""
        self._serving += 1
        try:
            async for message in super().rpc_aggregate_part(stream, context):
                yield message
            # keep this side of the stream open until the member closes its own, having received every reply: a
            # stream closed right after its last reply could lose it in the p2p daemon (``AllOrNothingRunner.
            # _exchange_with_reducer``). The member's close cancels this wait.
            await asyncio.sleep(_REPLY_LINGER)
        finally:
            self._serving -= 1
            with contextlib.suppress(RuntimeError):  # (the loop is closing: nothing is left to drain for)
                asyncio.get_running_loop().create_task(_drain(stream, _DRAIN_TIMEOUT))

    async def rpc_download_state(self, _request: averaging_pb2.DownloadRequest, _context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's, for members of a private run only, and at most ``MAX_UPLOADS_AT_ONCE`` at a time (an empty
        answer sends the peer to its next donor). The parameters keep hivemind's names: its servicer reads the
        request type by the parameter's name."""
        if self.access is not None and not await self.access.admits(self.dht, _context.remote_id):
            return
        if self._uploads >= MAX_UPLOADS_AT_ONCE:
            with self._uploads_declined.get_lock():
                self._uploads_declined.value += 1
            return
        self._uploads += 1
        with self._uploads_most.get_lock():
            self._uploads_most.value = max(self._uploads_most.value, self._uploads)
        try:
            async for message in super().rpc_download_state(_request, _context):
                yield message
            with self._uploads_served.get_lock():
                self._uploads_served.value += 1
        finally:
            self._uploads -= 1

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None, *,
                              donors: Sequence[bytes] = (), exclude: Sequence[bytes] = (), max_bytes: int = 2**62
                              ) -> Any:
        """hivemind's, with the donor's peer id in the result ``(metadata, tensors, donor)``, the donors to ask in
        order (hivemind only asks those of highest priority on the DHT, which may be the ones to avoid), donors to
        skip (they served a state that failed our checks), and at most ``max_bytes`` accepted from a donor.
        Cancelling the future stops the download at the donor's next message; ``downloaded`` counts its bytes."""
        future = MPFuture()
        self._outer_pipe.send(("_load_state_from_peers", [], dict(timeout=timeout, future=future, donors=tuple(donors),
                                                                   exclude=tuple(exclude), max_bytes=max_bytes)))
        return future.result(timeout=timeout) if wait else future

    @property
    def downloaded(self) -> float:
        """Bytes of state this peer received from donors so far (every download, whole or not)."""
        return self._downloaded.value

    async def _announce(self, access: RunAccess) -> None:
        try:
            await asyncio.wait_for(access.announce(self.dht, self.peer_id), timeout=self.request_timeout)
        except Exception as e:  # the donors may know us from our progress record anyway
            logger.debug("Could not announce this peer's download: %r", e)

    async def _load_state_from_peers(self, future: MPFuture, timeout: Optional[float] = None,
                                     donors: Sequence[bytes] = (), exclude: Sequence[bytes] = (),
                                     max_bytes: int = 2**62) -> None:
        state = None
        try:
            if self.access is not None:  # a private run's donors serve only peers that wrote through its DHT
                await self._announce(self.access)
            candidates = [PeerID(peer) for peer in donors if peer not in exclude] if donors else \
                await self._listed_donors(exclude)
            chunk_timeout = self.next_chunk_timeout or self.request_timeout
            for donor in candidates:
                if donor == self.peer_id or future.done():  # done: the host gave the download up
                    continue
                try:
                    state = await self._download_from(donor, chunk_timeout, max_bytes, future)
                except Exception as e:  # a donor that left or misbehaved: the next one
                    logger.debug(f"Could not download the state from {donor}: {e!r}")
                    continue
                if state is not None:
                    state = (*state, donor.to_bytes())
                    break
        finally:
            with contextlib.suppress(InvalidStateError):  # the host cancelled it meanwhile
                if not future.done():
                    future.set_result(state)

    async def _listed_donors(self, exclude: Sequence[bytes]) -> List[PeerID]:
        """The donors listed on the DHT, most advanced first (ties in random order: newcomers spread over them)."""
        found = await self.dht.get(f"{self._matchmaking.group_key_manager.prefix}.all_averagers", latest=True,
                                   return_future=True)
        donors = {PeerID(peer_id): (float(info.value), random.random())
                  for peer_id, info in (found.value.items() if isinstance(found, ValueWithExpiration)
                                        and isinstance(found.value, dict) else ())
                  if isinstance(peer_id, bytes) and peer_id not in exclude
                  and isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int))
                  and math.isfinite(info.value)}
        return sorted(donors, key=donors.get, reverse=True)

    async def _download_from(self, donor: PeerID, timeout: float, max_bytes: int, future: MPFuture
                             ) -> Optional[Tuple[Any, list]]:
        """One donor's state as hivemind streams it: metadata in the first message, each tensor in parts; ``None``
        once ``future`` is done (the host gave the download up: the rest is not read)."""
        stub = self.get_stub(self._p2p, donor, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, parts, tensors, received = None, [], [], 0
        async with contextlib.aclosing(stream):
            async for message in aiter_with_timeout(stream, timeout=timeout):
                if future.done():
                    return None
                size = message.ByteSize()
                received += size
                with self._downloaded.get_lock():
                    self._downloaded.value += size
                if received > max_bytes:
                    raise ValueError(f"the donor sent more than {max_bytes} bytes")
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # the first part of the next tensor
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return None if metadata is None else (metadata, tensors)

    def _runners(self, group_id: bytes) -> Iterator[Any]:
        """The all-reduce runners of a group started so far (several for engines that run phases, see powersgd)."""
        for _, runner in self._all_reduces(group_id):
            if not isinstance(runner, asyncio.Future):  # started
                yield runner

    def _all_reduces(self, group_id: bytes) -> Iterator[Tuple[bytes, Any]]:
        """Each all-reduce of a group by its key's suffix: its runner, or its registration future before it runs."""
        for key, future in list(self._running_groups.items()):
            if key.startswith(group_id):
                started = future.done() and not future.cancelled() and not future.exception()
                yield key[len(group_id):], future.result() if started else future

    async def _first_failure(self, group_info: Any) -> str:
        """Why the round can no longer succeed, as soon as that is known: a part failed, or a member has not started
        sending to this peer's share long after it should have. A member starts sending when its training loop
        hands it its values, at most one of its steps (it announces their duration) after the group formed; one
        that is later than that is dead or stuck, and hivemind would wait out ``next_chunk_timeout`` for it."""
        periods = {peer: _member_info(self.serializer, data).get(STEP_PERIOD_KEY, 0.0)
                   for peer, data in zip(group_info.peer_ids, group_info.gathered)}
        first_seen: Dict[int, float] = {}
        next_report = time.monotonic() + _STALL_REPORT_PERIOD
        while True:
            if time.monotonic() > next_report and logger.isEnabledFor(logging.DEBUG):  # diagnostics only
                next_report += _STALL_REPORT_PERIOD
                states = "; ".join(_runner_state(key, runner) for key, runner in self._all_reduces(group_info.group_id))
                logger.debug("Round still running: %s. %s", states or "no all-reduce started", _where_tasks_wait())
            for runner in self._runners(group_info.group_id):
                failure = partial_failure(runner)
                if failure:
                    return failure
                missing = _missing_senders(runner)
                if missing:
                    waited = time.monotonic() - first_seen.setdefault(id(runner), time.monotonic())
                    allowed = _start_allowance(periods.get(peer) for peer in missing)
                    if waited > allowed:
                        return (f"{len(missing)} member(s) did not start sending within {allowed:.1f} s: "
                                f"{', '.join(sorted(map(str, missing)))}")
            await asyncio.sleep(_FAILURE_POLL_PERIOD)

    def _say_goodbye(self, group_info: Any) -> None:
        """Tell every groupmate that this peer left the group's all-reduces: each of them fails the round at once
        (a sender that sends a CANCELLED message is banned, and an all-or-nothing reducer then stops), instead of
        waiting for parts that this peer will not send. In the background: the failure is this peer's to report
        now; the goodbyes take a round trip."""
        group_ids = [key for key in list(self._running_groups) if key.startswith(group_info.group_id)] \
            or [self._first_allreduce_id(group_info)]  # a group this peer never began averaging with
        others = [peer for peer in group_info.peer_ids if peer != self.peer_id]
        if others:
            task = asyncio.ensure_future(self._send_goodbyes(group_ids, others))
            self._goodbyes.add(task)
            task.add_done_callback(self._goodbyes.discard)

    def _first_allreduce_id(self, group_info: Any) -> bytes:
        """The id under which every member of ``group_info`` registers the group's first all-reduce."""
        return group_info.group_id

    async def _send_goodbyes(self, group_ids: List[bytes], peers: Sequence[PeerID]) -> None:
        async def goodbye(peer: PeerID, group_id: bytes) -> None:
            message = averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED, group_id=group_id)
            stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
            stream = await stub.rpc_aggregate_part(as_aiter(message))
            async with contextlib.aclosing(stream):  # closed by us: the groupmate's handler waits for that
                async for _ in stream:  # the reply (an error code) says it was heard
                    break

        try:
            await asyncio.wait_for(
                asyncio.gather(*(goodbye(peer, group_id) for peer in peers for group_id in group_ids),
                               return_exceptions=True),
                timeout=_GOODBYE_TIMEOUT)
        except asyncio.TimeoutError:
            logger.debug("Some groupmates did not acknowledge that this peer left the round")

    def _check_complete(self, group_id: bytes) -> None:
        """Fail the round if the all-reduce registered as ``group_id`` left any part not averaged by everyone."""
        future = self._running_groups.get(group_id)
        if future is not None and future.done() and not future.cancelled() and not future.exception() \
                and not isinstance(future.result(), _LaneRound):  # a lane all-reduce completes in full or raises
            failure = partial_failure(future.result())
            if failure:
                raise AllreduceException(failure)

    async def _shutdown(self, timeout: Optional[float]) -> None:  # runs in the averager process
        """hivemind's, made safe to run late: the p2p daemon may already be gone (its handlers with it; hivemind
        raised FileNotFoundError from a background thread, a traceback at the end of a clean Ctrl-C), and a group
        still registered is a future of a runner (hivemind calls ``finalize`` on the future and gathers what that
        returns, None). Between rounds, it first lets the means it reduced finish streaming (bounded): a peer that
        committed the last round of a run and left at once cut its groupmates off the last parts, and they failed the
        round that it had committed (their models then differed from its). Its round being complete, every sender
        had sent it every part: only the replies remain. A peer that leaves mid-round fails the round anyway."""
        deadline = time.monotonic() + min(_SERVING_GRACE, (timeout or 2 * _SERVING_GRACE) / 2)
        while self._serving and not self._running_groups and time.monotonic() < deadline:
            await asyncio.sleep(_FAILURE_POLL_PERIOD)
        if not self.client_mode:
            try:
                await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
            except (OSError, ConnectionError) as e:
                logger.debug("Averager handlers not removed, the p2p daemon is gone: %r", e)
        for future in list(self._running_groups.values()):
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)  # the runner tells its groupmates
            else:
                future.cancel()
        if self.lane is not None:
            self.lane.close()
        try:  # hivemind never shuts its replica down: each averager it ever started left a socket file in /tmp
            await self._p2p.shutdown()
        except Exception as e:  # noqa: BLE001 (the process ends next; the file is all that is at stake)
            logger.debug("The averager's p2p client did not shut down: %r", e)

    def commit(self, result: AveragingResult, round_id: int) -> None:  # runs in the host process
        """The host applied ``result`` as round ``round_id``; plain averaging keeps nothing from round to round."""

    def get_current_state(self):  # runs in the host process, in hivemind's state-fetching thread
        provider = self.state_provider
        if provider is None:
            return None, [], None
        metadata, tensors = provider()
        return metadata, list(tensors), None


class _LaneRound:
    """A lane round as hivemind's registry of running groups holds it: shutting down mid-round aborts it."""

    def __init__(self, lane: GlooLane, peer_ids: Sequence[bytes]) -> None:
        self._lane, self._peer_ids = lane, peer_ids

    def finalize(self, cancel: bool = False, **kwargs: Any) -> None:
        if cancel:
            self._lane.drop(self._peer_ids)


def _step_key(step: StepControl) -> int:
    """What names a step in both processes: the id of hivemind's future that a ``StepControl`` is."""
    return step._uid


def _reason(error: BaseException) -> str:
    """A failed round's exception in a few words (hivemind wraps the all-reduce's own in 'Unable to run ...')."""
    text = str(error).strip() or type(error).__name__
    return text.removeprefix("Unable to run All-Reduce: ").splitlines()[0][:200]


async def cancel_within(grace: float, *tasks: asyncio.Future) -> bool:
    """Cancel ``tasks`` and wait at most ``grace`` seconds for them to unwind (their errors retrieved, not raised).
    Bounded: a round must end even if something inside hivemind ignores its cancellation; what is left behind is
    logged at DEBUG with where it waits. Whether every task ended."""
    for task in tasks:
        task.cancel()
    done, pending = await asyncio.wait(tasks, timeout=grace)
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved: asyncio would report it otherwise
    if pending:
        logger.debug("%d cancelled task(s) did not unwind within %.0f s; left behind. %s", len(pending), grace,
                     _where_tasks_wait())
    return not pending


def _runner_state(suffix: bytes, runner: Any) -> str:
    """One all-reduce's progress in a line, for DEBUG reports of a round that does not end."""
    name = suffix.decode(errors="replace") or "main"
    if not isinstance(runner, AllOrNothingRunner):
        return f"{name}: {runner!r}"
    reducer, container = runner.tensor_part_reducer, runner.tensor_part_container
    return (f"{name}: parts by peer {container.num_parts_by_peer}, outputs registered "
            f"{container._outputs_registered_by_peer}, failed {container.failed_size}, senders active "
            f"{len(runner.active_senders)}/{len(runner.sender_peer_ids)} banned {len(runner.banned_senders)}, reducer "
            f"part {reducer.current_part_index}/{reducer.num_parts} taken {reducer.num_parts_taken} abandoned "
            f"{reducer.abandoned} finished {reducer.finished.is_set()}")


def _where_tasks_wait(limit: int = 40) -> str:
    """Where each pending task of the running event loop waits (its chain of awaits), for DEBUG reports."""
    lines = []
    for task in list(asyncio.all_tasks())[:limit]:
        chain, awaited = [], task.get_coro()
        while awaited is not None and len(chain) < 12:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
            if frame is None:
                chain.append(type(awaited).__name__)
                break
            chain.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
        lines.append(" > ".join(chain))
    return "Tasks waiting: " + " | ".join(sorted(lines))


def _pace_reads(matchmaking: Any) -> None:
    """Space hivemind's reads of the group key's declarations: ``_FIRST_READ_INTERVAL`` after a read that found a
    declaration the previous read had not (a peer arrived, or this peer's own search began), doubling while reads find
    nothing new, up to ``_READ_INTERVAL``. hivemind asks for a new read as each read returns while no better leader is
    in sight: on loopback, a search a millisecond, every other DHT call of the peer queued behind those reads
    (``docs/hivemind.md``). The peers of a round arrive together, so reads stay quick while they do: groups form as
    fast as unpaced."""
    manager = matchmaking.group_key_manager
    read, pace = manager.get_averagers, {"last": -math.inf, "interval": _FIRST_READ_INTERVAL, "found": None}

    async def get_averagers(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(max(0.0, pace["last"] + pace["interval"] - time.monotonic()))
        pace["last"] = time.monotonic()
        found = await read(*args, **kwargs)
        seen = (args, frozenset(found))
        pace["interval"] = _FIRST_READ_INTERVAL if seen != pace["found"] else min(_READ_INTERVAL, 2 * pace["interval"])
        pace["found"] = seen
        return found

    manager.get_averagers = get_averagers


def _write_near(dht: DHT) -> None:
    """This process's writes to the DHT (hivemind's matchmaking declarations and their withdrawals, its state-sharing
    declarations) go straight to each key's nearest nodes (``store_near``). hivemind's store searches first, and every
    node its search visits answers with every record under the key: for a matchmaking key, every declaration, twice per
    peer and round. Readers still search with the full beam, and find a record on whichever of the key's nodes holds
    it."""
    store = dht.store

    def store_near_key(key: Any, value: Any, expiration_time: float, subkey: Any = None, return_future: bool = False,
                       **kwargs: Any) -> Any:
        if subkey is None or kwargs:
            return store(key, value, expiration_time, subkey=subkey, return_future=return_future, **kwargs)
        return dht.run_coroutine(functools.partial(store_near, key=key, subkey=subkey, value=value,
                                                   expiration_time=expiration_time), return_future=return_future)

    dht.store = store_near_key


def _renew_finished_search(matchmaking: Any) -> None:
    """Give hivemind's matchmaking a fresh group future if a search that ended left its own behind. Each search ends
    by replacing the future it waited on; a cancelled search whose cleanup is cut short leaves it cancelled, and the
    next search, waiting on it, would fail at once ("the round was cancelled")."""
    if not matchmaking.is_looking_for_group and matchmaking.assembled_group.done():
        logger.debug("Matchmaking kept a finished group future from an earlier search; renewed")
        matchmaking.assembled_group = asyncio.Future()
        matchmaking.was_accepted_to_group.clear()


def cancel_step(control: StepControl) -> None:
    """``control.cancel()``, with the step's own state set first. hivemind's sets it last, after waking the averager
    process through the control's cancel future: an averager that wakes in between sees a step not cancelled, goes on
    looking for a group for it until its deadline, and holds matchmaking meanwhile. This peer's next rounds then
    queue behind that search, and as a leader it refuses every other round's followers: under load, a peer that
    missed one round missed every round after it. A step cancelled before (``shutdown()`` while ``all_reduce()``
    waits on it, then the waiter's own clean-up) is left as it is: hivemind's raises when cancelled twice."""
    if control.cancelled():
        return
    MPFuture.cancel(control)  # in the process that created the step: the shared state, visible to the averager now
    control.cancel()  # wakes the averager (its trigger and cancel futures)


def _start_allowance(step_periods: Iterable[Any]) -> float:
    """How long members with these announced step periods may take to start sending to a round: they join an
    all-reduce at their next step."""
    return _START_TIMEOUT + 2 * max((_seconds(period) for period in step_periods), default=0.0)


def _seconds(value: Any) -> float:
    """A member's announced step period, bounded: a lie can delay the detection of a dead member, never forever."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return 0.0
    return min(float(value), _MAX_STEP_PERIOD)


def _missing_senders(runner: Any) -> set:
    """The members that have not started sending to the share this peer reduces (empty if it reduces none)."""
    own_parts = runner.tensor_part_container.num_parts_by_peer[runner.ordered_peer_ids.index(runner.peer_id)]
    if own_parts == 0 or runner.all_senders_started.is_set():
        return set()
    return set(runner.sender_peer_ids) - runner.active_senders


async def _drain(stream: AsyncIterator[Any], timeout: float) -> None:
    """Read and drop what a member still sends after this peer's handler of its stream ended (a round that failed,
    or that this peer had already left: the member sends its other parts all the same), for up to ``timeout``.
    hivemind's stream handler puts each incoming message into a queue of five and, when that queue is full, waits for
    room before it looks whether the handler ended: a handler that stopped reading left it waiting forever, with the
    stream's socket, its buffers and five parts of a round held (averager processes grew by them and by their file
    descriptors through every soak). Taking the messages lets it see that the handler ended and close the stream."""
    async def read_all() -> None:
        async for _ in stream:
            pass

    with contextlib.suppress(Exception):  # a stream already ended, or being read elsewhere: nothing to drain
        await asyncio.wait_for(read_all(), timeout)
