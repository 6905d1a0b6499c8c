"""hivemind's butterfly all-reduce with all-or-nothing reducers.

In hivemind, a reducer that loses a sender (its stream broke, or it never started sending) goes on without it: the
parts it reduces afterwards are averaged over the remaining senders and returned to them as if nothing happened.
Only the reducer itself knows (``banned_senders``); its groupmates combine these parts with complete parts from the
other reducers and end up with a mixture that is nobody's average. Since a swarm_opt round commits only if it is
complete, the reducer here stops instead: once a sender has failed it returns no more parts, so every sender either
gets complete averages or sees the reducer fail (and its round fails too). Parts completed before the failure
are complete averages and are delivered as usual.

A reducer also waits for every sender's copy of a part and combines them with the run's ``Aggregation`` (the
weighted mean, or a robust estimate: ``swarm_opt.aggregation``) instead of summing them as they arrive.

A member that says goodbye (``CANCELLED``: it left the round) fails at once the parts it was to reduce for this peer.

Two more changes: reducers send means, encoded once, so that every member ends a round with identical values
(``AllOrNothingRunner``); and each member closes its stream to a reducer once it has every reply, the reducer
keeping its side open until then, since the p2p daemon could lose a reply sent just before the stream closed
(``AllOrNothingRunner._exchange_with_reducer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Set, Tuple

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

from swarm_opt.aggregation import Aggregation, Audited, Mean, RoundScores, judge_part, reduce_part, reputation_of

logger = logging.getLogger(__name__)
_EXACT = runtime_pb2.CompressionType.NONE


class AllOrNothingReducer(TensorPartReducer):
    """A ``TensorPartReducer`` that never completes a part without every sender, and combines the senders' copies
    of a part with an ``Aggregation`` once it has them all (hivemind sums them as they arrive, which only a mean
    allows). The combination runs in the event loop's executor: a robust one costs a few passes over the copies,
    and the loop keeps moving the other parts meanwhile."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, *,
                 aggregation: Aggregation = Mean(), left_out: Sequence[int] = ()) -> None:
        self.aggregation = aggregation
        self.left_out = frozenset(left_out)  # sender indices whose copies count with weight 0 (``Reputation``)
        self._judges = reputation_of(aggregation) is not None
        self.scores = RoundScores()  # ``Reputation``: its scores of the senders (by index) this round
        self._copies: Dict[int, Tuple[torch.Tensor, float]] = {}  # sender index -> its copy of the current part
        super().__init__(part_shapes, num_senders)
        self.num_parts_taken = [0] * num_senders  # copies in the reduction, per sender (not just arrived)
        #: a sender failed before every part was reduced: the reduction was abandoned (a sender that fails later
        #: only missed some of its replies; every part was complete, and so is the result of everyone else)
        self.abandoned = False

    def reset_accumulators(self) -> None:
        """Start collecting the next part (hivemind's also allocates a sum); with no parts at all, finish."""
        if self.current_part_index >= self.num_parts - 1:
            self.finalize()
            return
        self.current_part_index += 1
        self.current_part_accumulated_from = 0
        self.current_part_future = asyncio.Future()
        self.num_current_senders = self.num_senders  # all or nothing: every part waits for every sender
        self.accumulator, self._copies = None, {}

    def on_sender_failed(self, sender_index: int) -> None:
        self.sender_failed_after[sender_index] = self.num_parts_received[sender_index]
        if self.num_parts_taken[sender_index] < self.num_parts and not self.finished.is_set():
            self.abandoned = True
            self.finalize()  # waiting senders get an error instead of an average that lacks this sender

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        if self.finished.is_set():  # checked here: hivemind only checks after waiting for earlier parts
            raise AllreduceException("the reduction was abandoned: a member of the group failed")
        assert 0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts, "invalid part or sender"
        if tensor_part.shape != self.part_shapes[part_index]:  # network input: its sender gets banned
            raise AllreduceException(f"sender {sender_index} sent part {part_index} with shape "
                                     f"{tuple(tensor_part.shape)}, expected {tuple(self.part_shapes[part_index])}")
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # a sender sends its parts in order: wait for the earlier ones
            finished = asyncio.ensure_future(self.finished.wait())
            try:
                await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
            if self.finished.is_set():
                raise AllreduceException("the reduction was abandoned: a member of the group failed")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index and sender_index not in self._copies, "a part sent twice"
        future = self.current_part_future
        self._copies[sender_index] = (tensor_part, weight)
        self.num_parts_taken[sender_index] += 1
        if len(self._copies) == self.num_senders:
            self._combine_current_part()
        # shielded: every sender awaits this one future, and asyncio cancels the future that a cancelled task awaits;
        # a groupmate whose stream closes while it waits would cancel the part for everyone, this peer's own share
        # included, and the round would wait for a part that never comes
        return await asyncio.shield(future)

    def _combine_current_part(self) -> None:
        """Every sender's copy is in: combine them in the executor, and collect the next part meanwhile. The last
        part finishes the reduction only once combined (an auxiliary peer's runner ends when it is finished)."""
        copies, future = self._copies, self.current_part_future
        senders = sorted(copies)  # a fixed order: the result does not depend on who sent first
        combining = asyncio.get_event_loop().run_in_executor(
            None, _reduce_and_judge, self.aggregation, [copies[s][0] for s in senders],
            [0.0 if s in self.left_out else copies[s][1] for s in senders], self._judges)
        part, last = self.current_part_index, self.current_part_index == self.num_parts - 1
        combining.add_done_callback(lambda done: self._combined(done, future, part, last, senders))
        if not last:
            self.reset_accumulators()
        else:
            self._copies = {}

    def _combined(self, done: asyncio.Future, future: asyncio.Future, part: int, last: bool,
                  senders: Sequence[int]) -> None:
        if not future.done():
            if done.cancelled() or done.exception() is not None:  # e.g. no usable copy: the round fails
                self.abandoned = True  # seen at once by the round's watchdog (every sender gets the error too)
                reason = "cancelled" if done.cancelled() else repr(done.exception())
                logger.debug(f"Reducer: part {part} could not be reduced: {reason}")
                future.set_exception(AllreduceException(f"the part could not be reduced: {reason}"))
            else:
                result, scores = done.result()
                if scores is not None:
                    self.scores.add(senders, scores, self.part_shapes[part].numel())
                future.set_result(result)
        if last:
            self.finalize()


def _reduce_and_judge(aggregation: Aggregation, parts: Sequence[torch.Tensor], weights: Sequence[float],
                      judge: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``reduce_part``, and with ``Reputation`` every copy's scores against the result (``judge_part``)."""
    result = reduce_part(aggregation, parts, weights)
    return result, (judge_part(parts, weights, result) if judge else None)


class Traffic:
    """Bytes of tensors a peer sent and received in its all-reduces, in shared memory: counted where the round runs
    (the averager process for hivemind's path, the host or the averager process for the gloo lane), read in the
    host's (``TensorAverager.traffic``)."""

    def __init__(self) -> None:
        self._sent, self._received = mp.Value("d", 0.0), mp.Value("d", 0.0)

    def add(self, *, sent: int = 0, received: int = 0) -> None:
        for value, amount in ((self._sent, sent), (self._received, received)):
            if amount:
                with value.get_lock():
                    value.value += amount

    @property
    def totals(self) -> Tuple[int, int]:
        return int(self._sent.value), int(self._received.value)


class _Uncounted(Traffic):
    def __init__(self) -> None:  # no shared memory: nothing is counted
        pass

    def add(self, *, sent: int = 0, received: int = 0) -> None:
        pass


_NO_TRAFFIC = _Uncounted()


class AllOrNothingRunner(AllReduceRunner):
    """hivemind's ``AllReduceRunner`` with an ``AllOrNothingReducer``, whose reducers return means, not differences.

    hivemind's reducer sends each sender ``encode(mean − its part)``, and each member adds what it decodes to its own
    values: with a lossy codec every member ends with a different approximation of the mean (with fp32, different by
    a rounding), and members that never average their parameters (gradient averaging) drift apart round after round
    (8-bit codecs: 2e-2 after 50 epochs). Here a reducer encodes each averaged part once and sends every sender the
    same bytes, decodes them for its own share too, and every member copies the decoded means: all members end a
    round with identical values, bit for bit, whatever the codec (and a reducer encodes a part once instead of once
    per sender).
    """

    def __init__(self, *args: Any, aggregation: Aggregation = Mean(), start_timeout: float = 0.0,
                 left_out: Set[PeerID] = frozenset(), traffic: Optional[Traffic] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.traffic = _NO_TRAFFIC if traffic is None else traffic
        self.start_timeout = start_timeout  # how long a sender may take to start (see _handle_missing_senders)
        reducer = self.tensor_part_reducer  # replaced before anything could use it
        self.tensor_part_reducer = AllOrNothingReducer(
            reducer.part_shapes, reducer.num_senders, aggregation=aggregation,
            left_out=[i for i, peer in enumerate(self.sender_peer_ids) if peer in left_out])
        self.tensor_part_container.return_deltas = False  # the outputs are the group's means: members copy them
        self._part_codecs: Dict[int, int] = {}  # part index -> the compression type the senders' parts came in
        # (part index, compression type) -> [the encoded mean, how many senders have yet to take it]
        self._encoded_means: Dict[Tuple[int, int], List[Any]] = {}

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: Any
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's; a member whose message says that it left the round (``CANCELLED``: its goodbye) is done as a
        reducer too. hivemind only stops reducing its parts; this peer's parts that it was to reduce now fail at
        once (the round fails), instead of waiting ``reducer_timeout`` for means it will never send."""
        async def watched() -> AsyncIterator[averaging_pb2.AveragingData]:
            async for message in stream:
                if message.code == averaging_pb2.CANCELLED and context.remote_id in self.ordered_peer_ids:
                    self.tensor_part_container.register_failed_reducer(self.ordered_peer_ids.index(context.remote_id))
                yield message

        async for reply in super().rpc_aggregate_part(watched(), context):
            yield reply

    async def _handle_missing_senders(self) -> None:
        """hivemind's, waiting for the senders' first parts at least ``start_timeout``: a member starts sending at
        its next step, which may come after hivemind's next-chunk timeout; banned then, it failed the round."""
        try:
            timeout = None if self.sender_timeout is None else max(self.sender_timeout, self.start_timeout)
            await asyncio.wait_for(self.all_senders_started.wait(), timeout)
        except asyncio.TimeoutError:
            for peer_id in self.sender_peer_ids:
                if peer_id not in self.active_senders and peer_id not in self.banned_senders:
                    await self._ban_sender(peer_id)

    async def _encoded_mean(self, part_index: int, averaged_part: torch.Tensor, compression: int
                            ) -> runtime_pb2.Tensor:
        """The averaged part as the reducer sends it, encoded once for every sender (``averaged_part`` is the same
        tensor for all of them: the reducer completes a part when every sender's copy has arrived); dropped once
        every sender that decodes it has taken it."""
        key = (part_index, compression)
        entry = self._encoded_means.get(key)
        if entry is None:
            encoding = asyncio.get_event_loop().run_in_executor(None, serialize_torch_tensor, averaged_part,
                                                                 compression)
            # every remote sender takes it, and this peer's own share too unless the part is exact (not decoded)
            takers = len(self.sender_peer_ids) - (self.peer_id in self.sender_peer_ids and compression == _EXACT)
            entry = self._encoded_means[key] = [encoding, takers]
        entry[1] -= 1
        if entry[1] == 0:
            del self._encoded_means[key]
        # shielded: a taker cancelled while waiting (its sender left) must not cancel the encoding for the others
        return await asyncio.shield(entry[0])

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                          sender_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, sending the encoded mean itself (see the class docstring)."""
        part_index = 0

        def decode(msg: averaging_pb2.AveragingData) -> Tuple[torch.Tensor, float, int]:
            self.traffic.add(received=len(msg.tensor_part.buffer))
            return deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression

        try:
            async for tensor_part, weight, compression in amap_in_executor(
                decode,
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                self._part_codecs.setdefault(part_index, compression)
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight)
                except BannedException:
                    break  # this sender was banned: nothing more to reduce for it
                encoded = await self._encoded_mean(part_index, averaged_part, compression)
                part_index += 1
                self.traffic.add(sent=len(encoded.buffer))
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        """hivemind's; this peer's own share ends as the decoded mean its groupmates receive."""
        if peer_id != self.peer_id:
            await self._exchange_with_reducer(peer_id)
            return
        peer_index, sender_index = self.ordered_peer_ids.index(peer_id), self.sender_peer_ids.index(peer_id)
        try:
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                averaged_part = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=self.weight)
                compression = self._part_codecs.get(part_index)  # known once any other sender's copy has arrived
                if compression not in (None, _EXACT):  # (exact bytes decode to the very values: no round trip)
                    encoded = await self._encoded_mean(part_index, averaged_part, compression)
                    # decoded here, in the event loop's thread: the same message object is being copied into the
                    # senders' replies by this thread, and protobuf messages are not safe to read from two threads
                    # at once (decoding it in the executor crashed averager processes with heap corruption)
                    averaged_part = deserialize_torch_tensor(encoded)
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged_part)
        except BaseException as e:  # as for another member's share: the parts left are marked failed, so that
            # the round fails at once instead of its outputs waiting for parts that will never come
            logger.debug(f"This peer's own share failed: {e!r}")
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _counted(self, messages: AsyncIterator[averaging_pb2.AveragingData]
                       ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in messages:
            self.traffic.add(sent=len(message.tensor_part.buffer))
            yield message

    async def _exchange_with_reducer(self, peer_id: PeerID) -> None:
        """hivemind's exchange with another member's reducer: send it this peer's parts of its share, receive their
        means. Except that this side closes the stream, as soon as it has every part it expects.

        In hivemind the reducer closes the stream right after its last reply, and the p2p daemon may drop that reply
        when its side of the stream closes first: we saw a reducer send every reply while a member received none
        ("sent 0 parts, but we expected 1"; about one round in 200 with 4 peers on a loaded machine), failing that
        member's round after the others had completed it. The reducer now keeps its side open until the member
        closes (``swarm_opt._hivemind.engine``, bounded), so the member closes first and nothing is in flight then."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._counted(self._generate_input_for_peer(peer_index)), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            def decode(message: averaging_pb2.AveragingData) -> torch.Tensor:
                if message.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
                self.traffic.add(received=len(message.tensor_part.buffer))
                return deserialize_torch_tensor(message.tensor_part)

            received = 0
            try:
                replies = amap_in_executor(decode, aiter_with_timeout(stream, self.reducer_timeout),
                                           max_prefetch=self.tensor_part_container.prefetch)
                async with contextlib.aclosing(replies):
                    async for part in replies:
                        self.tensor_part_container.register_processed_part(peer_index, received, part)
                        received += 1
                        if received == expected:
                            break
            finally:
                await stream.aclose()  # closes this side: the reducer's handler then ends
            if received != expected:
                raise AllreduceException(f"peer {peer_id} sent {received} parts, but we expected {expected}")
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug(f"Caught {e!r} when communicating to {peer_id}")
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise


# --- Audited: every part reduced twice ------------------------------------------------------------------------------

AUDIT_SUFFIX = b".audit"  # the second all-reduce of an audited round runs under the group id + this


def audit_order(peer_ids: Sequence[PeerID], parts: Sequence[int]) -> Optional[List[PeerID]]:
    """The peer order of an audited round's second all-reduce: the same shares (the fractions stay in place, so the
    parts are cut the same), each reduced by the next member that reduces a part, cyclically, so that two different
    members reduce every part. ``parts``: how many parts each share holds (the first runner's
    ``num_parts_by_peer``): hivemind deals whole parts, so a member with a nonzero fraction of a small model may
    reduce none, and a rotation through it would pair a liar with one partner only (never named). None if fewer
    than two members reduce."""
    reducers = [i for i, count in enumerate(parts) if count > 0]
    if len(reducers) < 2:
        return None
    order = list(peer_ids)
    for j, i in enumerate(reducers):
        order[i] = peer_ids[reducers[(j + 1) % len(reducers)]]
    return order


def part_owners(runner: AllReduceRunner) -> List[Tuple[int, int]]:
    """(share index, number of values) of every part of ``runner``'s tensors, in the order of the flattened tensors
    (hivemind cuts the tensors into parts in order and deals them to the shares in order). Read before it runs."""
    parts = runner.tensor_part_container._input_parts_by_peer  # hivemind's, not consumed before the round runs
    return [(share, part.numel()) for share, queue in enumerate(parts) for part, _ in queue]


def partial_failure(runner: AllReduceRunner) -> str:
    """Why an all-reduce runner can no longer average every part with everyone ('' while it still can). A sender
    that this peer's reducer lost after reducing every part (it left, or failed on its side, before taking its last
    replies) does not count: every part was complete, this peer's result and its other groupmates' included."""
    banned, failed = len(runner.banned_senders), runner.tensor_part_container.failed_size
    if runner.tensor_part_reducer.abandoned or failed:
        return f"partial all-reduce: {banned} sender(s) failed, {failed} values not averaged"
    return ""


def audit_evidence(audited: Audited, runners: Sequence[AllReduceRunner], owners: Sequence[Tuple[int, int]],
                   first: Sequence[torch.Tensor], second: Sequence[torch.Tensor], first_order: Sequence[PeerID],
                   second_order: Sequence[PeerID]) -> Set[Tuple[PeerID, PeerID]]:
    """The reducers' disagreements of an audited round (``disagreeing_reducers``), only if both all-reduces
    averaged every part: hivemind fills a part whose reducer failed with this member's own values, which differ from
    the other reducer's mean without anyone lying, and differently on each member (each sees its own values and
    its own failures): such a round fails as partial, and names nobody."""
    for runner in runners:
        failure = partial_failure(runner)
        if failure:
            raise AllreduceException(failure)
    return disagreeing_reducers(audited, owners, first, second, first_order, second_order)


def disagreeing_reducers(audited: Audited, owners: Sequence[Tuple[int, int]], first: Sequence[torch.Tensor],
                         second: Sequence[torch.Tensor], first_order: Sequence[PeerID],
                         second_order: Sequence[PeerID]) -> Set[Tuple[PeerID, PeerID]]:
    """The pairs of reducers (of the first and of the second all-reduce) whose results of some part differ."""
    flat_first = torch.cat([t.reshape(-1) for t in first])
    flat_second = torch.cat([t.reshape(-1) for t in second])
    pairs, offset = set(), 0
    for share, size in owners:
        if audited.disagree(flat_first[offset:offset + size], flat_second[offset:offset + size]):
            pairs.add((first_order[share], second_order[share]))
        offset += size
    return pairs


def liars(pairs: Set[Tuple[PeerID, PeerID]]) -> Set[PeerID]:
    """The members that disagreed with two different reducers in one round. The rotation pairs each reducer with
    the one before it and the one after, so a reducer that lies in both of its roles disagrees with both, who agree
    with everyone else (with one liar among three reducers or more). One disagreeing pair, or two reducers in all,
    names suspects and no liar."""
    partners: Dict[PeerID, Set[PeerID]] = {}
    for first, second in pairs:
        partners.setdefault(first, set()).add(second)
        partners.setdefault(second, set()).add(first)
    return {peer for peer, others in partners.items() if len(others) >= 2}
