"""What the DHT process does with requests whose sender is gone (``swarm_opt._hivemind.dht_process``); what it
inherits from the trainer: ``test_fork.py``."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
from hivemind.utils.timed_storage import get_dht_time

from swarm_opt._hivemind.dht_process import OwnGroupDHT, SturdyDHT


def _request_then_vanish(dht) -> None:
    """In a forked child: ask the DHT process for a record, and end before it reads the request (the request's
    reply pipe is handed over by this process as the DHT unpickles it: nobody is left to hand it over)."""
    from hivemind.utils.mpfuture import MPFuture

    dht._outer_pipe.send(("_get", [], dict(key="anything", latest=False, future=MPFuture())))
    os._exit(0)


@pytest.mark.parametrize("dht_type", [SturdyDHT, OwnGroupDHT])
def test_a_request_from_a_process_that_ended_is_dropped_and_the_dht_serves_on(dht_type):
    """hivemind's own loop logs a traceback and pauses ``wait_timeout`` (3 s) for each such request (where the
    sender's reply pipe cannot be fetched), or dies of it (EOFError: the sender was ending as it was asked)."""
    dht = dht_type(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        for _ in range(3):
            child = mp.get_context("fork").Process(target=_request_then_vanish, args=(dht,))
            child.start()
            child.join(10)
            assert child.exitcode == 0
        started = time.monotonic()
        assert dht.store("key", "value", get_dht_time() + 30)
        assert dht.get("key").value == "value" and dht.is_alive()  # the DHT process serves on
        assert time.monotonic() - started < 4.5, "the DHT process paused for the requests it could not read"
    finally:
        dht.shutdown()
