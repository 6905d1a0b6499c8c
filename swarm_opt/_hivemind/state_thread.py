"""The host-side thread through which hivemind's averager process asks for the state a newcomer downloads.

hivemind's own (``hivemind.averaging.averager._background_thread_fetch_current_state``) keeps the last state it
served referenced until the next request comes: a copy of the parameters and the optimizer's state (``3 x`` the
parameter bytes with Adam), held for as long as the peer runs. And a daemon thread that still holds it when the
interpreter exits frees it during finalization: a large tensor's deallocation waits for the GIL, a thread waiting
for the GIL at finalization exits through a C++ frame, and the process aborts (``terminate called without an
active exception``; seen with the 100M-parameter language model, ``benchmarks/large_model.py``). This thread keeps
nothing between requests and gives the copy's memory back to the system (glibc keeps freed blocks of a few MB for
itself), and ``join`` lets the averager's host side wait for it to end at shutdown. ``install``
makes hivemind's averagers start it (every ``DecentralizedAverager`` created afterwards, ours and hivemind's).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Optional

import hivemind.averaging.averager as hivemind_averager

from swarm_opt._libc import malloc_trim

logger = logging.getLogger(__name__)

_THREADS: weakref.WeakKeyDictionary[Any, threading.Thread] = weakref.WeakKeyDictionary()


def serve_state_requests(serializer: Any, pipe: Any, get_current_state_ref: Callable[[], Any]) -> None:
    """hivemind's thread, as its averager starts it (same arguments): serve each request, then drop it."""
    owner = get_current_state_ref()
    if owner is not None:
        _THREADS[owner.__self__] = threading.current_thread()
    del owner
    while True:
        try:
            trigger, future = pipe.recv()
        except BaseException as e:  # the pipe closed: the averager is gone
            logger.debug("State-serving thread finished: %r", e)
            return
        if trigger == "_SHUTDOWN":
            return
        if not _serve(serializer, future, get_current_state_ref):
            return
        del future  # hivemind's future keeps its result, the whole state, for as long as it is referenced
        malloc_trim()  # the state's copy, freed: glibc would keep its memory for itself (3 x the parameter bytes)


def _serve(serializer: Any, future: Any, get_current_state_ref: Callable[[], Any]) -> bool:
    """Answer one request (the state, or the error that prevented it); False once the averager is gone. Everything
    it made dies with this call."""
    get_current_state = get_current_state_ref()
    if get_current_state is None:
        return False
    try:
        state = tuple(get_current_state())
        del get_current_state
        if not 0 < len(state) <= 3:
            raise ValueError(f"get_current_state returned {len(state)} items, expected 1 to 3")
        metadata, tensors, infos = state + (None,) * (3 - len(state))
        # on the CPU here, so that the averager process never initializes an accelerator
        tensors = tuple(t.cpu().detach().requires_grad_(t.requires_grad) for t in tensors)
        future.set_result((serializer.dumps(metadata), tensors, infos))
    except BaseException as e:
        future.set_exception(e)
        logger.warning("Could not serve this peer's state: %s", repr(e))  # a string: the record must not keep the state
    return True


def join(averager: Any, timeout: float) -> None:
    """Wait (at most ``timeout`` seconds) for ``averager``'s state-serving thread to end, after hivemind's
    ``shutdown`` told it to."""
    thread: Optional[threading.Thread] = _THREADS.pop(averager, None)
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)


def install() -> None:
    hivemind_averager._background_thread_fetch_current_state = serve_state_requests
