"""What the DHT process does with what it inherited from the trainer, and with requests whose sender is gone
(``swarm_opt._hivemind.dht_process``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import warnings

import pytest
import torch
import torch.distributed  # noqa: F401  (its deprecated ``reduce_op`` warns when asked its class: the walk must not)
from hivemind.utils.timed_storage import get_dht_time

from swarm_opt._hivemind.dht_process import OwnGroupDHT, SturdyDHT, drop_inherited_tensors


def _child(queue, big, view, shared, from_numpy) -> None:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        freed = drop_inherited_tensors()
    queue.put(([str(w.message) for w in said], freed, big.untyped_storage().nbytes(), view.untyped_storage().nbytes(),
               shared.untyped_storage().nbytes(), from_numpy.untyped_storage().nbytes()))


def test_a_forked_process_frees_the_tensors_it_inherited_and_the_trainer_keeps_them():
    big = torch.ones(4_000_000)  # a model's parameters: 16 MB
    view = big[10:20]  # the same storage: freed once
    shared = torch.ones(1000).share_memory_()  # an averaging buffer, shared with another process: left alone
    from_numpy = torch.from_numpy(torch.ones(100).numpy().copy())  # not resizable: left alone
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue, big, view, shared, from_numpy))
    child.start()
    said, freed, big_left, view_left, shared_left, numpy_left = queue.get(timeout=60)
    child.join(30)
    assert not said  # a DHT process prints nothing of it
    assert freed >= big.numel() * 4 and big_left == view_left == 0
    assert shared_left == 4000 and numpy_left == 400
    assert float(big.sum()) == 4_000_000 and float(shared.sum()) == 1000  # the parent's own, untouched


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
