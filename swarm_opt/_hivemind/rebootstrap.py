"""Finding the swarm's DHT again when a DHT node has lost sight of it (a link down for a while, a restarted bootstrap
node).

hivemind's ``DHTNode`` drops a peer from its routing table at the first RPC to it that fails, and pings its initial
peers only once, at start. A node whose link goes down while it searches ends with an empty table within seconds,
the others drop it too, and when the link comes back nobody dials anybody: the two sides stay apart for good. A
bootstrap node restarted with its identity starts with an empty table and is not contacted again either (see
``docs/hivemind.md``, "Partitions").

``DHTWatcher`` looks at one DHT's routing table every few seconds from a thread of the process that started the
DHT (one small coroutine in the DHT process per look, ``DHT.run_coroutine``). It remembers the peers it saw and the
addresses their connections used, and dials again, with a bounded exponential backoff per peer, every remembered
peer and initial peer that is missing from the table: a ping that is answered puts both nodes back into each other's
table, and a search for its own id then refills the table, as ``DHTNode.create`` does at start. When the table holds
nobody, or at most half of the most it held over the last minute, the watcher says so in one line, retries every
address at once, and says in one more line when it sees the swarm again. A healthy node prints nothing.

``watch_dht(dht)`` starts one watcher per DHT (a second call returns the first); ``stop_watching(dht)`` stops it,
and it stops by itself once the DHT process has exited. ``WatchedDHT`` is a ``hivemind.DHT`` whose ``shutdown()``
stops its watcher first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Dict, List, Optional, Sequence, Tuple

import hivemind

logger = logging.getLogger(__name__)
MAX_DIALS_PER_LOOK = 16  # the longest-waiting first; the others at the next looks


@dataclass(frozen=True)
class WatchConfig:
    """How a ``DHTWatcher`` looks and retries; every value in seconds."""

    period: float = 3.0  # between two looks at the routing table
    min_backoff: float = 2.0  # first wait before dialling a missing peer again; doubles at each failure ...
    max_backoff: float = 10.0  # ... up to this: a peer is dialled again at most this long after its link is back
    recent: float = 60.0  # "a moment ago": the largest table seen over this window is the reference
    forget_after: float = 900.0  # a peer missing this long is dialled no more (initial peers always are)
    dial_timeout: float = 5.0  # one dial, one ping

    def __post_init__(self) -> None:
        for name in ("period", "min_backoff", "max_backoff", "recent", "forget_after", "dial_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WatchConfig.{name} must be positive, got {getattr(self, name)}")
        if self.max_backoff < self.min_backoff:
            raise ValueError(f"WatchConfig.max_backoff ({self.max_backoff}) must not be below min_backoff "
                             f"({self.min_backoff})")


@dataclass
class _Known:
    """A peer worth dialling when it is missing from the table."""

    addrs: List[str]  # multiaddrs without the /p2p part
    initial: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    backoff: float = 0.0
    next_try: float = 0.0


def split_peer_maddr(maddr: str) -> Tuple[str, str]:
    """``/ip4/.../tcp/N/p2p/ID`` -> (ID, ``/ip4/.../tcp/N``)."""
    from hivemind.utils.multiaddr import Multiaddr

    full = Multiaddr(maddr)
    peer_id = full.value_for_protocol("p2p")
    return peer_id, str(full.decapsulate(Multiaddr(f"/p2p/{peer_id}")))


class DHTWatcher:
    """Re-bootstraps one ``hivemind.DHT`` whose routing table lost its contacts; see the module docstring."""

    def __init__(self, dht, initial_peers: Sequence[str] = (), config: Optional[WatchConfig] = None) -> None:
        self.dht = dht
        self.config = config or WatchConfig()
        self.lost_since: Optional[float] = None  # monotonic time the watcher found the table emptied, None if not
        self._lost_reference = 0
        self._announce: Optional[Tuple[int, int, int]] = None  # a loss not yet said: (size, reference, addresses)
        self._level = logging.WARNING  # of the lines about the current loss
        self._history: List[Tuple[float, int]] = []  # (time, table size) over the last ``recent`` seconds
        self._known: Dict[str, _Known] = {}
        self._table: set = set()  # peer ids in the routing table at the last look
        for maddr in initial_peers:
            peer_id, addr = split_peer_maddr(str(maddr))
            self._known[peer_id] = _Known([addr], initial=True, next_try=time.monotonic() + self.config.period)
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm_opt-dht-watcher", daemon=True)

    def start(self) -> DHTWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop looking (a look in flight is abandoned)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    @property
    def lost(self) -> bool:
        return self.lost_since is not None

    def _dht_alive(self) -> bool:
        try:
            return os.getpid() == self._pid and self.dht.is_alive()
        except (AssertionError, ValueError, OSError):  # not the DHT's parent process, or already closed
            return False

    def _run(self) -> None:
        while not self._stop.is_set() and self._dht_alive():
            try:
                urgent = self._look_once()
            except Exception as e:  # never let a failed look end the watch; the next one may succeed
                logger.debug(f"DHT watcher: a look failed: {e!r}")
                urgent = False
            if self._stop.wait(0 if urgent else self.config.period):
                break

    def _look_once(self) -> bool:
        """One look (and the dials that are due); True if the table was just found lost (dial everyone at once)."""
        now = time.monotonic()
        due = sorted((known.next_try, peer_id) for peer_id, known in self._known.items()
                     if known.next_try <= now and peer_id not in self._table)
        due = [(peer_id, self._known[peer_id].addrs) for _, peer_id in due[:MAX_DIALS_PER_LOOK]]
        found = self._call(partial(_look, due=due, timeout=self.config.dial_timeout))
        if found is None:
            return False
        own_peer_id, table, responded, refused = found
        self._table = set(table)
        self._known.pop(own_peer_id, None)
        now = time.monotonic()
        for peer_id, addrs in table.items():
            known = self._known.setdefault(peer_id, _Known(addrs))
            known.addrs = sorted(set(addrs) | set(known.addrs)) if known.initial else (addrs or known.addrs)
            known.last_seen, known.backoff, known.next_try = now, 0.0, now
        for peer_id, _ in due:
            known = self._known.get(peer_id)
            if known is None or peer_id in table:
                continue
            if peer_id in responded:  # answered, but not in the table yet: look again at the next look
                known.next_try = now
                continue
            known.backoff = min(max(known.backoff * 2, self.config.min_backoff), self.config.max_backoff)
            known.next_try = now + known.backoff
        for peer_id in [p for p, k in self._known.items()
                        if not k.initial and p not in table and now - k.last_seen > self.config.forget_after]:
            del self._known[peer_id]
        if self._announce is not None and due:
            self._say_lost(everyone_refused=bool(refused) and len(refused) == len(due))
        return self._judge(len(table), now)

    def _say_lost(self, everyone_refused: bool) -> None:
        """The first line of a loss, once its first dials are answered: a warning, unless every peer dialled refused
        the connection (their hosts are up and nothing listens: the peers left, as at the end of a run)."""
        size, reference, addresses = self._announce
        self._announce, self._level = None, logging.INFO if everyone_refused else logging.WARNING
        left = " (the peers it dialled refused the connection: they left)" if everyone_refused else ""
        logger.log(self._level, f"Lost sight of the swarm's DHT (this node sees {size} of the {reference} peers it "
                                f"saw in the last {self.config.recent:.0f} s){left}; re-bootstrapping from "
                                f"{addresses} known address{'' if addresses == 1 else 'es'}")

    def _judge(self, size: int, now: float) -> bool:
        """Track the table's size; say when it lost its contacts and when it has them again."""
        self._history = [(t, n) for t, n in self._history if now - t <= self.config.recent] + [(now, size)]
        if self.lost_since is None:
            reference = max(n for _, n in self._history)
            if not _too_few(size, reference):
                return False
            self.lost_since, self._lost_reference = now, reference
            for known in self._known.values():
                known.next_try, known.backoff = now, 0.0
            missing = {addr for peer_id, known in self._known.items() if peer_id not in self._table
                       for addr in known.addrs}
            self._announce = (size, reference, len(missing))  # said after the first dials (``_say_lost``)
            return True
        if not _too_few(size, self._lost_reference):
            if self._announce is None:  # else found again before anything was said: nothing to say
                logger.log(self._level, f"Found the swarm's DHT again: this node sees {size} peers "
                                        f"({now - self.lost_since:.0f} s after it lost sight of them)")
            self.lost_since, self._history, self._announce = None, [(now, size)], None
        elif now - self.lost_since > self.config.forget_after:
            logger.log(self._level, f"The swarm's DHT still shows this node {size} of the {self._lost_reference} "
                                    f"peers it saw {self.config.forget_after:.0f} s ago; taking {size} as the "
                                    f"swarm's size now")
            self.lost_since, self._history, self._announce = None, [(now, size)], None
        return False

    def _call(self, coroutine) -> Optional[tuple]:
        """Run ``coroutine`` in the DHT process; None if the DHT went away or the watch was stopped meanwhile."""
        try:
            future = self.dht.run_coroutine(coroutine, return_future=True)
        except (OSError, ValueError, EOFError, BrokenPipeError):  # the DHT's pipe is closed: it is shutting down
            self._stop.set()
            return None
        limit = time.monotonic() + self.config.dial_timeout * 3 + 5.0
        while not future.done():  # a stop or the DHT's end abandons a look (its dials end with the DHT process)
            if time.monotonic() > limit or not self._dht_alive() or self._stop.wait(0.05):
                return None
        return future.result()


def _too_few(size: int, reference: int) -> bool:
    """Has a table of ``size`` lost sight of a swarm where it saw ``reference`` peers?"""
    return size < reference and (size == 0 or size <= reference // 2)


async def _look(dht, node, *, due: List[Tuple[str, List[str]]], timeout: float):
    """In the DHT process: dial and ping the ``due`` peers, refill the table from any that answered, and return
    (own peer id, {peer id: connection addresses} of the routing table, peer ids that answered)."""
    from hivemind.p2p import PeerID

    table = node.protocol.routing_table
    due = [(peer_id, addrs) for peer_id, addrs in due if PeerID.from_base58(peer_id) not in table.peer_id_to_uid]
    responded: List[str] = []
    refused: List[str] = []
    if due:
        answers = await asyncio.gather(*(_reach(node, peer_id, addrs, timeout) for peer_id, addrs in due))
        responded = [peer_id for (peer_id, _), answer in zip(due, answers) if answer == _ANSWERED]
        refused = [peer_id for (peer_id, _), answer in zip(due, answers) if answer == _REFUSED]
        if responded:
            await asyncio.sleep(0)  # the pings' routing-table updates run as tasks of their own
            try:  # DHTNode.create's last stage: find this node's nearest neighbours, which fills the table
                await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout)
            except Exception:
                pass
    connected: Dict[str, List[str]] = {}
    try:
        for info in await asyncio.wait_for(node.p2p.list_peers(), timeout):
            connected[info.peer_id.to_base58()] = [str(addr) for addr in info.addrs]
    except Exception:
        pass
    peers = {peer_id.to_base58(): connected.get(peer_id.to_base58(), []) for peer_id in table.peer_id_to_uid}
    return node.peer_id.to_base58(), peers, responded, refused


_ANSWERED, _REFUSED, _UNREACHABLE = "answered", "refused", "unreachable"


async def _reach(node, peer_id: str, addrs: List[str], timeout: float) -> str:
    """Dial ``peer_id`` at ``addrs`` (the daemon may also know others) and ping it, which adds each to the other's
    routing table. Says whether it answered, whether its host refused the connection (it is up, the peer is gone),
    or neither (a link down, a host off).

    Where every address is a plain TCP one, a bare TCP connection to it (closed at once, nothing sent) comes first,
    and the daemon dials only when one was accepted. libp2p puts an address that failed to dial in a backoff that
    grows with each failure (5 s + n² s, up to 5 minutes) and refuses to dial it again meanwhile, from this peer's
    every part (its DHT, its averager): a watcher that dialled every few seconds through a 3-minute partition left
    each peer unable to reach the other side for up to a minute after the links came back."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    peer = PeerID.from_base58(peer_id)
    probed = await _tcp_probe(addrs, timeout)
    if probed is not None and probed != _ANSWERED:
        return probed
    refused = False
    if addrs:
        try:
            await asyncio.wait_for(node.p2p._client.connect(peer, [Multiaddr(a) for a in addrs]), timeout)
        except Exception as e:  # the ping below still tries whatever addresses the daemon knows
            refused = "connection refused" in str(e)
    try:
        answered = await asyncio.wait_for(node.protocol.call_ping(peer), timeout) is not None
    except Exception:
        answered = False
    return _ANSWERED if answered else _REFUSED if refused else _UNREACHABLE


async def _tcp_probe(addrs: List[str], timeout: float) -> Optional[str]:
    """Whether any of ``addrs`` accepts a TCP connection (``_ANSWERED``), refuses it (``_REFUSED``: its host is up,
    nothing listens) or neither (``_UNREACHABLE``); None when an address is not plain TCP (a relay, QUIC, a DNS
    name): the daemon knows how to dial those."""
    endpoints = []
    for addr in addrs:
        found = _TCP_ADDR.fullmatch(addr)
        if found is None:
            return None
        endpoints.append((found.group(2), int(found.group(3))))
    if not endpoints:
        return None

    async def probe(host: str, port: int) -> str:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except ConnectionRefusedError:
            return _REFUSED
        except (OSError, asyncio.TimeoutError):
            return _UNREACHABLE
        writer.close()
        return _ANSWERED

    answers = await asyncio.gather(*(probe(host, port) for host, port in endpoints))
    return next((a for a in (_ANSWERED, _REFUSED) if a in answers), _UNREACHABLE)


_TCP_ADDR = re.compile(r"/(ip4|ip6)/([^/]+)/tcp/(\d+)")
_watchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_watchers_lock = threading.Lock()


def watch_dht(dht, initial_peers: Optional[Sequence[str]] = None,
              config: Optional[WatchConfig] = None) -> Optional[DHTWatcher]:
    """Start re-bootstrapping ``dht`` (a started ``hivemind.DHT``) whenever it loses sight of the swarm; once per
    DHT: a second call returns the running watcher. ``initial_peers`` default to those the DHT was started with.
    A DHT whose process this process did not start, or that is not running, is not watched (None)."""
    try:
        running = dht.is_alive() is True  # also False for a test double
    except (AssertionError, ValueError):  # another process's DHT: its parent watches it
        running = False
    if not running:
        return None
    with _watchers_lock:
        watcher = _watchers.get(dht)
        if watcher is not None and watcher._thread.is_alive():
            return watcher
        if initial_peers is None:
            initial_peers = [str(maddr) for maddr in (getattr(dht, "initial_peers", None) or ())]
        watcher = _watchers[dht] = DHTWatcher(dht, initial_peers, config).start()
        return watcher


def stop_watching(dht) -> None:
    """Stop ``dht``'s watcher, if it has one (before ``dht.shutdown()``, so that it sends the DHT nothing more)."""
    with _watchers_lock:
        watcher = _watchers.pop(dht, None)
    if watcher is not None:
        watcher.stop()


class WatchedDHT(hivemind.DHT):
    """``hivemind.DHT`` whose ``shutdown()`` first stops its watcher (``watch_dht``), so that the watcher sends the
    DHT process nothing after its pipe is closed."""

    def shutdown(self) -> None:
        stop_watching(self)
        super().shutdown()
