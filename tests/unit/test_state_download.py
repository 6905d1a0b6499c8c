"""Why a state download failed, kept by ``TensorAverager.load_state`` for the error the user sees."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from swarm_opt._hivemind.tensor_averager import TensorAverager
from swarm_opt.config import Timeouts
from swarm_opt.deadlines import MIN_DOWNLOAD_RATE


class _Engine:
    """The averager process's side of a download: ``outcome`` (the result, or an exception raised by the call), after
    ``seconds``, with ``rate`` bytes per second arriving until then (``downloaded``)."""

    def __init__(self, outcome, seconds: float = 0.0, rate: float = 0.0):
        self.outcome, self.seconds, self.rate = outcome, seconds, rate
        self.future: concurrent.futures.Future = concurrent.futures.Future()

    def load_state_from_peers(self, wait=True, timeout=None, donors=(), exclude=(), max_bytes=None):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        self.started = time.monotonic()
        if self.seconds == 0.0:
            self.future.set_result(self.outcome)
        else:
            threading.Timer(self.seconds, lambda: self.future.done() or self.future.set_result(self.outcome)).start()
        return self.future

    @property
    def downloaded(self) -> float:
        return self.rate * (min(time.monotonic() - self.started, self.seconds) if hasattr(self, "started") else 0.0)


def _averager(engine) -> TensorAverager:
    averager = TensorAverager.__new__(TensorAverager)  # no network: only load_state's bookkeeping is under test
    averager._engine = engine if isinstance(engine, _Engine) else _Engine(engine)
    averager._state_bytes = 1024
    # a window of 0.15 s (next_chunk_timeout 0.1 + request_timeout 0.05) in which the state must keep arriving
    averager.timeouts = Timeouts(matchmaking_time=0.1, averaging_timeout=0.3)
    return averager


def test_each_kind_of_failed_download_keeps_its_reason():
    cases = [(None, "no peer sent its state"),
             (_Engine(("state", [], b""), seconds=60.0), "no donor sent its state within 1 s"),
             (BrokenPipeError("the averager process is gone"), "BrokenPipeError: the averager process is gone")]
    for outcome, reason in cases:
        averager = _averager(outcome)
        assert averager.load_state(timeout=1.0) is None
        assert reason in averager.last_download_failure
    assert cases[1][0].future.cancelled()  # the averager process stops reading what nobody waits for


def test_a_download_returns_what_the_donor_sent():
    state = ({"epoch": 3}, [])
    assert _averager(state).load_state(timeout=1.0) is state


def test_a_download_that_keeps_receiving_goes_on_past_its_timeout_and_one_that_trickles_does_not():
    state, moved = ({"epoch": 3}, []), []
    arriving = _averager(_Engine(state, seconds=1.5, rate=4 * MIN_DOWNLOAD_RATE))
    assert arriving.load_state(timeout=0.5, on_extend=moved.append) is state
    assert moved and all(seconds == pytest.approx(0.15) for seconds in moved)  # the other ranks hear each move
    trickling = _averager(_Engine(state, seconds=1.5, rate=MIN_DOWNLOAD_RATE / 4))
    started = time.monotonic()
    assert trickling.load_state(timeout=0.5) is None
    assert time.monotonic() - started < 1.2
    assert "arrived slower than 32 KiB/s" in trickling.last_download_failure
    assert trickling._engine.future.cancelled()


def _control(kind=None):
    """A scheduled round (hivemind's ``StepControl``, or the subclass ``kind``) attached to its trigger and cancel
    futures, as the averager process attaches them."""
    from hivemind.averaging.control import StepControl
    from hivemind.utils import MPFuture

    trigger = MPFuture()  # first: hivemind sets up its futures' backend only for a plain MPFuture
    control = (kind or StepControl)(scheduled_time=0.0, deadline=1e9, allow_retries=False, weight=1.0,
                                    data_for_gather=b"")
    control.attach(trigger, MPFuture())
    return control


def _cancelled_control():
    """A scheduled round whose future raises what hivemind's raise when the round is cancelled under it."""
    import asyncio

    from hivemind.averaging.control import StepControl

    class Cancelled(StepControl):
        def allow_allreduce(self):
            pass

        def result(self, timeout=None):
            raise asyncio.CancelledError()

    return _control(Cancelled)


def test_a_round_cancelled_under_all_reduce_fails_instead_of_killing_the_training_loop():
    import contextlib
    import threading

    import torch
    from hivemind.utils import MPFuture

    from swarm_opt.config import Timeouts

    averager = TensorAverager.__new__(TensorAverager)
    control = _cancelled_control()
    averager._engine = type("E", (), {"get_tensors": lambda self: contextlib.nullcontext([torch.zeros(2)])})()
    averager._lock, averager._running, averager.timeouts = threading.Lock(), None, Timeouts()
    averager._scheduled_round = -1  # nothing scheduled ahead
    watch = MPFuture()
    watch.set_result(("done", None))  # what the averager process says as the cancelled step ends

    def schedule(when, round_id):
        averager._scheduled, averager._scheduled_watch, averager._scheduled_round = control, watch, round_id
        averager._scheduled_at = (when, when, 60.0)  # its search's start, due time, safety net

    averager.schedule = schedule
    assert averager.all_reduce(lambda buffers: None, 1.0, round_id=3) is None
    assert averager.last_failure == "the round was cancelled" and control.cancelled()


def test_a_step_cancelled_twice_raises_nothing():
    """``shutdown()`` cancels the round that ``all_reduce()`` waits on in another thread, and the waiter then cancels
    it again as it cleans up: the second cancel must not raise (hivemind's does) into the thread running the round."""
    from swarm_opt._hivemind.engine import cancel_step

    control = _control()
    cancel_step(control)
    cancel_step(control)
    assert control.cancelled() and control._trigger.cancelled()
