"""The host-side thread that serves this peer's state to its averager process (``swarm_opt._hivemind.state_thread``)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import threading
import time
import weakref

import hivemind.averaging.averager as hivemind_averager
import torch
from hivemind.utils import MSGPackSerializer

from swarm_opt._hivemind import (
    engine,  # noqa: F401  (installs the thread)
    state_thread,
)

SERVED: list = []


class _Future:
    """What the thread answers: the averager process's future (pickled through the pipe, as hivemind's is)."""

    def set_result(self, result):
        metadata, tensors, _ = result
        SERVED.append((MSGPackSerializer.loads(metadata), [t.shape for t in tensors]))

    def set_exception(self, e):
        SERVED.append(repr(e))  # as it reaches the averager process: without its traceback


class _Averager:
    def __init__(self):
        self.made = []

    def get_current_state(self):
        state = torch.zeros(1000)  # a fresh copy, as swarm_opt's snapshot is
        self.made.append(weakref.ref(state))
        return {"epoch": len(self.made)}, [state]


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_every_averager_created_from_now_on_starts_this_thread():
    assert hivemind_averager._background_thread_fetch_current_state is state_thread.serve_state_requests


def test_a_served_state_is_not_kept_until_the_next_request_and_the_thread_ends_when_told():
    """hivemind's own thread keeps the last state it served (a copy of parameters and optimizer state) referenced
    until the next request; this one drops it at once, and ``join`` waits for it to end after ``_SHUTDOWN``."""
    SERVED.clear()
    averager = _Averager()
    ours, theirs = mp.Pipe()
    thread = threading.Thread(target=state_thread.serve_state_requests, daemon=True,
                              args=(MSGPackSerializer, theirs, weakref.WeakMethod(averager.get_current_state)))
    thread.start()
    for expected in (1, 2):
        ours.send(("_TRIGGER_GET_CURRENT_STATE", _Future()))
        wait_until(lambda n=expected: len(SERVED) == n)
        assert SERVED[-1] == ({"epoch": expected}, [torch.Size([1000])])
        wait_until(lambda: (gc.collect(), averager.made[-1]() is None)[1])  # nothing holds what was served
    ours.send(("_SHUTDOWN", None))
    state_thread.join(averager, timeout=10)
    assert not thread.is_alive()


def test_an_error_in_the_state_reaches_the_asking_process_and_the_thread_serves_on():
    SERVED.clear()

    class Broken(_Averager):
        def get_current_state(self):
            if not self.made:
                self.made.append(None)
                raise RuntimeError("no state yet")
            return super().get_current_state()

    averager = Broken()
    ours, theirs = mp.Pipe()
    thread = threading.Thread(target=state_thread.serve_state_requests, daemon=True,
                              args=(MSGPackSerializer, theirs, weakref.WeakMethod(averager.get_current_state)))
    thread.start()
    ours.send(("_TRIGGER_GET_CURRENT_STATE", _Future()))
    ours.send(("_TRIGGER_GET_CURRENT_STATE", _Future()))
    wait_until(lambda: len(SERVED) == 2)
    assert SERVED[0] == "RuntimeError('no state yet')" and SERVED[1][0] == {"epoch": 2}
    del averager  # the averager gone: the thread ends at its next request
    ours.send(("_TRIGGER_GET_CURRENT_STATE", _Future()))
    thread.join(10)
    assert not thread.is_alive()
