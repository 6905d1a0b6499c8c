"""A reducer's stream whose handler ended while the member still sends: closed, not held forever.

hivemind's stream handler queues at most five incoming messages and, with the queue full, waits for room before it
checks whether the handler ended. The averager's ``rpc_aggregate_part`` ends early (a round that failed, or that
the peer left) while the member sends its other parts; left there, each such stream held its socket and five parts
of a round for the life of the averager process (``swarm_opt._hivemind.engine._drain``). Two real p2p daemons on
loopback, one process."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2

from swarm_opt._hivemind.engine import _drain
from swarm_opt._hivemind.memtrace import _awaiting

# hivemind's P2P.create finds its daemon with importlib.resources.path, deprecated in this Python: its warning
pytestmark = [pytest.mark.swarm, pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:path is deprecated:DeprecationWarning")]

PARTS = 40  # a member's parts, of 64 kB each: more than the handler's queue and the sockets' buffers hold


def _waiting_to_queue() -> int:
    """Tasks of this loop stuck where hivemind's stream handler waits for room in its queue."""
    return sum("_handle_stream" in where and "Queue.put" in where
               for where in map(_awaiting, (t.get_coro() for t in asyncio.all_tasks())))


async def _one_member_sending_after_the_handler_ended(drained: bool) -> int:
    reducer = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    member = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await reducer.get_visible_maddrs())
    try:
        async def handler(stream: AsyncIterator[averaging_pb2.AveragingData], _context: P2PContext
                          ) -> AsyncIterator[averaging_pb2.AveragingData]:
            try:
                await stream.__anext__()  # the first part names a group that is gone: answered at once
                yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
                await asyncio.sleep(1.0)  # lingers without reading, as the averager's handler does after its replies
            finally:
                if drained:
                    asyncio.get_running_loop().create_task(_drain(stream, 5.0))

        await reducer.add_protobuf_handler("aggregate", handler, averaging_pb2.AveragingData, stream_input=True,
                                           stream_output=True)

        async def parts() -> AsyncIterator[averaging_pb2.AveragingData]:
            for _ in range(PARTS):
                yield averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=bytes(64 * 1024)))
            await asyncio.sleep(30)  # the member keeps its stream open (its round still runs)

        replies = await member.iterate_protobuf_handler(reducer.peer_id, "aggregate", parts(),
                                                        averaging_pb2.AveragingData)
        assert (await replies.__anext__()).code == averaging_pb2.BAD_GROUP_ID
        await asyncio.sleep(3.0)  # the member's parts fill the reducer's queue meanwhile; then its handler ends
        return _waiting_to_queue()
    finally:
        await member.shutdown()
        await reducer.shutdown()


def test_hivemind_holds_a_stream_whose_handler_stopped_reading():
    """The trap itself, so that this test notices the day hivemind no longer sets it."""
    assert asyncio.run(_one_member_sending_after_the_handler_ended(drained=False)) == 1


def test_a_drained_stream_is_closed_once_its_handler_ended():
    assert asyncio.run(_one_member_sending_after_the_handler_ended(drained=True)) == 0
