"""A peer matched into a group ahead of its round that then leaves the round (its host caught up with the swarm
instead) tells its groupmates at once: two real averager processes on two real DHTs."""

from __future__ import annotations

import threading
import time

import hivemind
import pytest
import torch
from hivemind.utils import get_dht_time

from swarm_opt._hivemind.tensor_averager import TensorAverager
from swarm_opt.config import Timeouts

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


@pytest.mark.parametrize("leaver_leads", [True, False], ids=["leaver leads", "leaver follows"])
def test_a_peer_that_cancels_a_matched_round_does_not_hold_its_groupmate(leaver_leads):
    """Whichever leads the group (the first to declare): as a follower, the leaver reduced a share of the sender's
    parts, which must fail at once too, not after the sender's wait for its means."""
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = hivemind.DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    timeouts = Timeouts(matchmaking_time=1.0, averaging_timeout=10.0)
    averagers = []
    try:
        averagers = [TensorAverager(dht, prefix="leaving_run", templates=[torch.zeros(4)], timeouts=timeouts)
                     for dht in (first, second)]
        sender, leaver = averagers
        outcome = {}

        def send() -> None:
            outcome["result"] = sender.all_reduce(lambda buffers: buffers[0].fill_(1.0), 1.0, round_id=1)
            outcome["ended"] = time.monotonic()

        thread = threading.Thread(target=send)
        if leaver_leads:
            leaver.schedule(get_dht_time(), round_id=1)  # matchmaking ahead of the round: not triggered
            time.sleep(0.2)
        thread.start()
        if not leaver_leads:
            time.sleep(0.2)
            leaver.schedule(get_dht_time(), round_id=1)
        deadline = time.monotonic() + 30
        while not leaver.matched(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert leaver.matched(1), "the two peers did not form a group"
        left = time.monotonic()
        leaver.cancel_scheduled()  # as a host that caught up with the swarm does
        thread.join(30)
        assert outcome["result"] is None  # the round failed for the sender too
        # told at once, not after the groupmate's start timeout (3 s and more) for a part that never comes
        assert outcome["ended"] - left < 1.5, (outcome["ended"] - left, sender.last_failure)
        assert "did not start sending" not in sender.last_failure, sender.last_failure
    finally:
        for averager in averagers:
            averager.shutdown()
        second.shutdown()
        first.shutdown()
