"""The all-or-nothing reducer: once a sender failed, nobody receives a part averaged without it (hivemind's reducer
returns such parts as if they were complete, and groupmates of a failed round would commit a mixture)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.partition import TensorPartReducer
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from swarm_opt._hivemind.allreduce import AllOrNothingReducer, AllOrNothingRunner


async def _sender_fails_mid_part(reducer_type: type) -> object:
    """Two senders, two parts: sender 0 sends part 0, then sender 1 fails before sending it. What does sender 0
    get back for part 0?"""
    reducer = reducer_type([torch.Size([3]), torch.Size([3])], num_senders=2)
    waiting = asyncio.ensure_future(reducer.accumulate_part(0, 0, torch.ones(3), weight=1.0))
    await asyncio.sleep(0)
    reducer.on_sender_failed(1)
    try:
        return await asyncio.wait_for(waiting, timeout=5)
    except (AllreduceException, asyncio.CancelledError) as e:
        return e


def test_hivemind_reducer_returns_a_part_averaged_without_the_failed_sender():
    result = asyncio.run(_sender_fails_mid_part(TensorPartReducer))
    assert isinstance(result, torch.Tensor) and torch.equal(result, torch.ones(3))  # sender 0's values alone


def test_all_or_nothing_reducer_returns_no_partial_average():
    result = asyncio.run(_sender_fails_mid_part(AllOrNothingReducer))
    assert not isinstance(result, torch.Tensor), result


async def _complete_part_then_failure() -> tuple:
    reducer = AllOrNothingReducer([torch.Size([2]), torch.Size([2])], num_senders=2)
    first = await asyncio.gather(reducer.accumulate_part(0, 0, torch.zeros(2), weight=1.0),
                                 reducer.accumulate_part(1, 0, torch.full((2,), 4.0), weight=3.0))
    reducer.on_sender_failed(1)
    with pytest.raises(AllreduceException):  # a later part of the surviving sender: refused at once
        await reducer.accumulate_part(0, 1, torch.zeros(2), weight=1.0)
    return first


def test_parts_completed_before_a_failure_are_complete_averages():
    first = asyncio.run(_complete_part_then_failure())
    for part in first:
        assert torch.equal(part, torch.full((2,), 3.0))  # (0 * 1 + 4 * 3) / 4


def _bare_runner(senders: list) -> AllOrNothingRunner:
    """A runner with just what its cache of encoded means uses (no network): this peer is "me"."""
    runner = object.__new__(AllOrNothingRunner)
    runner.peer_id, runner.sender_peer_ids, runner._encoded_means = "me", senders, {}
    return runner


async def _takes(compression: int, takes: int) -> dict:
    """A reducer of 3 senders (itself included) hands out one averaged part ``takes`` times; what stays cached?"""
    runner = _bare_runner(["a", "me", "b"])
    encoded = [await runner._encoded_mean(0, torch.arange(4.0), compression) for _ in range(takes)]
    assert all(e is encoded[0] for e in encoded)  # encoded once, the same bytes for everyone
    return runner._encoded_means


def test_an_encoded_mean_is_dropped_once_every_sender_that_decodes_it_took_it():
    exact, lossy = runtime_pb2.CompressionType.NONE, runtime_pb2.CompressionType.FLOAT16
    assert asyncio.run(_takes(exact, 2)) == {}  # the 2 remote senders; the own share of an exact part skips it
    assert len(asyncio.run(_takes(lossy, 2))) == 1  # the own share decodes a lossy part: still expected
    assert asyncio.run(_takes(lossy, 3)) == {}


async def _failure_before_and_after_the_last_part() -> tuple:
    early = AllOrNothingReducer([torch.Size([2]), torch.Size([2])], num_senders=2)
    await asyncio.gather(early.accumulate_part(0, 0, torch.zeros(2)), early.accumulate_part(1, 0, torch.ones(2)))
    early.on_sender_failed(1)  # part 1 is still owed
    late = AllOrNothingReducer([torch.Size([2])], num_senders=2)
    means = await asyncio.gather(late.accumulate_part(0, 0, torch.zeros(2)), late.accumulate_part(1, 0, torch.ones(2)))
    late.on_sender_failed(1)  # every part complete: only sender 1's reply may be lost
    return early.abandoned, late.abandoned, means


def test_a_sender_lost_after_the_last_part_does_not_abandon_the_reduction():
    """A reducer that loses a sender after every part was reduced delivered complete means to the others: neither
    they nor the reducer itself may fail the round for it (the lost sender fails its own side)."""
    early, late, means = asyncio.run(_failure_before_and_after_the_last_part())
    assert early and not late
    assert all(torch.equal(m, torch.full((2,), 0.5)) for m in means)


async def _shared_encoding_with_a_cancelled_taker() -> torch.Tensor:
    runner = _bare_runner(["a", "b", "c"])
    exact = runtime_pb2.CompressionType.NONE
    first = asyncio.ensure_future(runner._encoded_mean(0, torch.arange(4.0), exact))
    second = asyncio.ensure_future(runner._encoded_mean(0, torch.arange(4.0), exact))
    await asyncio.sleep(0)
    first.cancel()  # this taker's sender left while the part was being encoded
    return deserialize_torch_tensor(await second)


def test_a_taker_that_leaves_does_not_cancel_the_encoding_for_the_others():
    assert torch.equal(asyncio.run(_shared_encoding_with_a_cancelled_taker()), torch.arange(4.0))


def test_a_leader_refuses_followers_of_another_round_but_never_helpers():
    """A follower whose gather names another round than the leader's step would only form a group whose result
    every member discards: the leader refuses it at once. Helpers, and gathers without a round, are not refused."""
    from types import SimpleNamespace

    from hivemind.utils import MSGPackSerializer

    from swarm_opt._hivemind.gather import rounds_differ as _rounds_differ

    def gather(info) -> bytes:
        return MSGPackSerializer.dumps([1.0, 0, MSGPackSerializer.dumps(info)])

    leader = SimpleNamespace(data_for_gather=gather({"round": 4}))
    assert _rounds_differ(MSGPackSerializer, gather({"round": 3}), leader)
    assert _rounds_differ(MSGPackSerializer, gather({"round": 5}), leader)
    assert not _rounds_differ(MSGPackSerializer, gather({"round": 4}), leader)
    assert not _rounds_differ(MSGPackSerializer, gather({"round": 3, "aux": True}), leader)
    assert not _rounds_differ(MSGPackSerializer, gather({"round": 3}), None)  # not looking: hivemind refuses
    for junk in (gather({}), gather({"round": "3"}), gather({"round": True}), gather([3]), b"\x00garbage"):
        assert not _rounds_differ(MSGPackSerializer, junk, leader)


async def _sender_starting_late(start_timeout: float) -> set:
    """A reducer's runner whose sender "late" starts 0.2 s into the round; hivemind's next-chunk timeout is 0.05 s.
    Which senders does the runner ban?"""
    runner = _bare_runner(["me", "late"])
    runner.sender_timeout, runner.start_timeout = 0.05, start_timeout
    runner.active_senders, runner.banned_senders = {"me"}, set()
    runner.all_senders_started = asyncio.Event()

    async def ban(peer: str) -> None:
        runner.banned_senders.add(peer)

    runner._ban_sender = ban

    async def start_late() -> None:
        await asyncio.sleep(0.2)
        runner.active_senders.add("late")
        runner.all_senders_started.set()

    await asyncio.gather(runner._handle_missing_senders(), start_late())
    return runner.banned_senders


def test_a_sender_is_given_the_groups_start_allowance_not_the_next_chunk_timeout():
    """A member joins the all-reduce at its next step, which may come later than hivemind's next-chunk timeout;
    banned then, it failed a round that it would have completed (``_start_allowance``)."""
    assert asyncio.run(_sender_starting_late(start_timeout=1.0)) == set()
    assert asyncio.run(_sender_starting_late(start_timeout=0.0)) == {"late"}  # hivemind's own bound


def test_a_cancelled_step_is_cancelled_before_the_averager_is_woken():
    """The averager process checks ``step.cancelled()`` as soon as the control's cancel future wakes it: the step's
    own state must already say so (hivemind's ``StepControl.cancel`` sets it last, and an averager that looked in
    between went on looking for a group for a step nobody wanted, blocking the peer's next rounds)."""
    from hivemind.averaging.control import StepControl
    from hivemind.utils import MPFuture

    from swarm_opt._hivemind.engine import cancel_step

    seen = []

    class Wakeup(MPFuture):  # stands for the averager's cancel future: records what the woken averager would see
        def set_result(self, result):
            seen.append(control.cancelled())
            super().set_result(result)

    trigger = MPFuture()  # first: hivemind sets up its futures' backend only for a plain MPFuture
    control = StepControl(scheduled_time=0.0, deadline=1e9, allow_retries=False, weight=1.0, data_for_gather=b"")
    control.attach(trigger, Wakeup())
    cancel_step(control)
    assert seen == [True] and control.cancelled()


async def _stubborn_and_obedient() -> tuple:
    """One task that ignores its cancellation (keeps waiting, as a stream close inside hivemind may), one that
    obeys: ``cancel_within`` returns after its grace period anyway, the obedient task cancelled."""
    from swarm_opt._hivemind.engine import cancel_within

    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(60)

    tasks = asyncio.ensure_future(stubborn()), asyncio.ensure_future(asyncio.sleep(60))
    await asyncio.sleep(0)
    started = asyncio.get_event_loop().time()
    ended = await cancel_within(0.2, *tasks)
    took = asyncio.get_event_loop().time() - started
    stubborn_task, obedient = tasks
    left_pending = not stubborn_task.done()
    stubborn_task.cancel()  # the second cancellation ends it: nothing left behind by the test
    await asyncio.gather(stubborn_task, return_exceptions=True)
    return ended, took, left_pending, obedient.cancelled()


def test_a_cancelled_aggregation_that_does_not_unwind_does_not_hold_the_round(caplog):
    with caplog.at_level("DEBUG", logger="swarm_opt._hivemind.engine"):
        ended, took, left_pending, obedient_cancelled = asyncio.run(_stubborn_and_obedient())
    assert not ended and left_pending and obedient_cancelled
    assert took < 5.0, took
    # the DEBUG report says where the task left behind waits
    assert any("stubborn:" in record.getMessage() for record in caplog.records), caplog.text


async def _own_share_whose_part_fails() -> tuple:
    """This peer ("me") reduces the only part; both copies arrive with weight 0, so the part cannot be reduced.
    Does the round's output still end (with the part marked failed) and does the watchdog see the failure?"""
    from hivemind.averaging.partition import TensorPartContainer

    from swarm_opt._hivemind.allreduce import partial_failure

    container = TensorPartContainer([torch.ones(3)], peer_fractions=(1.0, 0.0), return_deltas=False)
    runner = _bare_runner(["me", "b"])
    runner.ordered_peer_ids, runner.weight, runner._part_codecs = ["me", "b"], 0.0, {}
    runner.tensor_part_container = container
    runner.tensor_part_reducer = AllOrNothingReducer([torch.Size([3])], num_senders=2)
    runner.banned_senders = set()
    runner.parts_for_local_averaging = container.get_raw_input_parts(0)
    other = asyncio.ensure_future(runner.tensor_part_reducer.accumulate_part(1, 0, torch.ones(3), weight=0.0))
    own = asyncio.ensure_future(runner._communicate_with_peer("me"))
    outputs = [t async for t in container.iterate_output_tensors()]  # hangs if the own share's parts never come
    results = await asyncio.gather(own, other, return_exceptions=True)
    return outputs, results, container.failed_size, partial_failure(runner)


def test_an_own_share_that_cannot_be_reduced_fails_the_round_at_once():
    outputs, results, failed_size, failure = asyncio.run(asyncio.wait_for(_own_share_whose_part_fails(), 10))
    assert all(isinstance(r, AllreduceException) for r in results), results  # both senders told
    assert len(outputs) == 1 and failed_size == 3  # the output ended, its part marked failed
    assert failure.startswith("partial all-reduce"), failure  # what the round's watchdog reports


async def _a_waiting_sender_leaves() -> list:
    """Three senders of one part: two have sent theirs and wait; one of them leaves (its stream handler is
    cancelled, as when the groupmate closes its stream); then the third sends. What do the two others get?"""
    reducer = AllOrNothingReducer([torch.Size([3])], num_senders=3)
    staying = asyncio.ensure_future(reducer.accumulate_part(0, 0, torch.ones(3)))
    leaving = asyncio.ensure_future(reducer.accumulate_part(1, 0, torch.ones(3)))
    await asyncio.sleep(0.01)
    leaving.cancel()
    await asyncio.sleep(0.01)
    last = asyncio.ensure_future(reducer.accumulate_part(2, 0, torch.ones(3)))
    return await asyncio.wait_for(asyncio.gather(staying, last, return_exceptions=True), 5)


def test_a_sender_that_leaves_while_waiting_does_not_cancel_the_part_for_the_others():
    """Every sender awaits the same future of the part: cancelling one waiter must not cancel that future (asyncio
    cancels the future a cancelled task awaits), or the others' own share dies with it and their round waits for it
    until its timeout."""
    results = asyncio.run(_a_waiting_sender_leaves())
    assert all(isinstance(r, torch.Tensor) and torch.equal(r, torch.ones(3)) for r in results), results


def test_a_search_that_left_its_group_future_finished_is_renewed_before_the_next():
    """hivemind's matchmaking waits on ``assembled_group``; a cancelled search whose cleanup was cut short left it
    cancelled, and the next search failed at once. A finished future is renewed, but never during a search."""
    from types import SimpleNamespace

    from swarm_opt._hivemind.engine import _renew_finished_search

    async def run() -> tuple:
        left = asyncio.get_event_loop().create_future()
        left.cancel()
        idle = SimpleNamespace(is_looking_for_group=False, assembled_group=left, was_accepted_to_group=asyncio.Event())
        idle.was_accepted_to_group.set()
        _renew_finished_search(idle)
        searching = SimpleNamespace(is_looking_for_group=True, assembled_group=left,
                                    was_accepted_to_group=asyncio.Event())
        _renew_finished_search(searching)
        return idle, searching, left

    idle, searching, left = asyncio.run(run())
    assert not idle.assembled_group.done() and not idle.was_accepted_to_group.is_set()
    assert searching.assembled_group is left  # a search in progress owns its future
