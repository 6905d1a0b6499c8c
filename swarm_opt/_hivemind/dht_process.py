"""A hivemind DHT process in a process group of its own, so that a terminal's Ctrl-C reaches the user's process only.

hivemind starts its Go ``p2pd`` daemon from the DHT process through uvloop, and libuv's spawn resets every signal to
its default in the new process: a SIGINT ignored by the DHT process is not ignored by the daemon. A Ctrl-C in a
terminal (SIGINT to the whole foreground process group) killed the daemon while the peer was still finishing its
step: the round in flight failed for its groupmates, the progress record was never withdrawn, and the averager
process died with a traceback when it could not unregister its handlers.

So the DHT process moves to a group of its own before it starts the daemon. Nothing would then kill it together with
the user's process group (``kill -9 -PGID``, a closed terminal), so it asks the kernel for SIGTERM when its parent
dies (``PR_SET_PDEATHSIG``), and answers SIGTERM by removing the daemon's unix sockets and killing its own group,
itself and the daemon, at once (hivemind sends SIGTERM only to a DHT that did not shut down in time). Where
``prctl`` is missing (not Linux) the DHT stays in the caller's group, as plain hivemind does.

The DHT process is forked from the trainer, usually after the model was built, and never reads a tensor it inherited.
Their pages would be shared with the trainer only until the trainer writes them, as it does at every step, and from
then on be this process's own copy, held for nothing (400 MB for a 100M-parameter model). So it is forked without
them, sharing the rest of the trainer's heap (``swarm_opt._hivemind.fork.forking_helper``).
"""

from __future__ import annotations

import logging
import os
import signal
from functools import partial
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, Optional, Tuple

import hivemind.dht.dht as hivemind_dht

from swarm_opt._hivemind.rebootstrap import WatchedDHT
from swarm_opt._hivemind.tasks import hold_tasks_of_loops_made_by
from swarm_opt._libc import die_with_parent

if TYPE_CHECKING:
    from swarm_opt._hivemind.fork import SharedHeap

logger = logging.getLogger(__name__)


def _kill_own_group(dht: Any, signum: int, frame: object) -> None:
    """Kill this process and its daemon at once, removing first the two unix sockets their P2P link listens on (at a
    SIGKILL nobody else would: 600 stale ``/tmp/hivemind-*.sock`` files after a day of killed test peers)."""
    p2p = getattr(getattr(dht, "_node", None), "p2p", None)
    for maddr in (getattr(p2p, "_daemon_listen_maddr", None), getattr(p2p, "_client_listen_maddr", None)):
        try:
            os.unlink(maddr["unix"])
        except Exception:  # noqa: BLE001 (no P2P yet, not a unix socket, already gone: nothing to remove)
            pass
    os.killpg(0, signal.SIGKILL)


class _Requests:
    """The DHT process's end of its request pipe, read as hivemind's loop reads it, except that a request which
    cannot be unpickled is dropped (a DEBUG line) instead of ending the process with a traceback. Each request
    carries a pipe end of its sender's, which the sending process hands over as the request is unpickled: a process
    that sent one just before it ended (an averager leaving) is no longer there to do so. A pipe that every sender
    closed without asking for a shutdown (they all died) is a shutdown."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe

    def fileno(self) -> int:
        return self._pipe.fileno()

    def poll(self, timeout: float = 0.0) -> bool:
        return self._pipe.poll(timeout)

    def recv(self) -> Tuple[str, list, dict]:
        try:
            message = self._pipe.recv_bytes()
        except EOFError:
            return ("_shutdown", [], {})
        try:
            return ForkingPickler.loads(message)
        except Exception as e:  # noqa: BLE001 (its sender is gone, and nobody waits for the answer)
            logger.debug("Dropped a DHT request whose sender is gone: %r", e)
            return ("_dropped_request", [], {})


class SturdyDHT(WatchedDHT):
    """``hivemind.DHT`` whose process holds every task of its event loop until it ends
    (``swarm_opt._hivemind.tasks``) and drops requests whose sender is gone (``_Requests``). Its ``shutdown()``
    stops its re-bootstrapping watcher first (``swarm_opt._hivemind.rebootstrap``)."""

    #: the frozen objects this DHT's process shares with its parent (``swarm_opt._hivemind.fork``), if it was
    #: forked inside ``forking_helper()``
    shared_heap: Optional[SharedHeap] = None

    def run(self) -> None:  # in the DHT process
        self._inner_pipe = _Requests(self._inner_pipe)
        hold_tasks_of_loops_made_by(hivemind_dht)
        super().run()

    def shutdown(self) -> None:
        super().shutdown()
        if self.shared_heap is not None:
            self.shared_heap.ended()

    async def _dropped_request(self) -> None:
        """What the DHT process runs for a request it could not read: nothing."""


class OwnGroupDHT(SturdyDHT):
    """``SturdyDHT`` whose process (and p2p daemon) leaves the caller's process group; dies with its parent."""

    def run(self) -> None:  # runs in the DHT process, before hivemind starts the daemon
        # a SIGTERM before the handler is in place kills this process alone, before it has started the daemon
        if die_with_parent(signal.SIGTERM, self._parent_pid):
            os.setpgid(0, 0)  # before the handler: it kills the group this process is in
            signal.signal(signal.SIGTERM, partial(_kill_own_group, self))
        super().run()
