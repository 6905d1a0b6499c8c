"""The gloo fast lane: a group that hivemind formed all-reduces its round over a torch.distributed gloo process group.

hivemind stays the control plane (DHT, progress, matchmaking); the lane only moves a formed group's tensors. A peer
with the lane on announces its address in the matchmaking gather. A group whose every member announced one runs its
round on the lane; any other group runs hivemind's path; one round never mixes the two, because every member decides
from the same gathered data. The first member of the group's order hosts the rendezvous: a ``TCPStore`` that every
lane peer serves on its own listening socket (bound to the interface the user names). Process groups are cached by
membership; each round, members tell each other through the store which cached group they hold (and their weights),
and create a new one under the round's group id unless they all hold the same. A failed round drops the membership's
group. Each round's handshake keys are deleted once it completed; a new process group leaves a few small keys in the
host's store (one set per group created, not per round).

gloo neither authenticates nor encrypts: the lane is opt-in, for trusted networks only (docs/gloo-lane.md). In a
private run its store keys derive from the run secret, so that an outsider cannot predict them; anyone who can reach
the ports can still list the keys, read the traffic or disturb a round.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from swarm_opt._hivemind.gather import LANE_KEY  # a member's lane address, "host:port"
from swarm_opt.buffers import all_finite, scale_and_check
from swarm_opt.errors import ConfigError, ConfigTypeError

logger = logging.getLogger(__name__)

_MAX_ADDRESS_CHARS = 64
_CACHED_GROUPS = 4  # process groups kept per peer (each holds gloo threads and one connection per member)
_CACHED_STORES = 8  # connections to other members' rendezvous stores
_SMALL_TENSOR = 2**18  # values: tensors below this travel coalesced into one flat buffer per round


@dataclass(frozen=True)
class Gloo:
    """Average a round over torch.distributed's gloo when every member of its group has the lane on.

    For trusted networks only (a lab's LAN, one cloud VPC): gloo neither authenticates nor encrypts.

    :param host: the IP address of the interface the lane binds to and announces; groupmates must reach it.
    :param port: the rendezvous port: 0 for any free port, or an inclusive range ``(first, last)`` to try in order
        (open it in the firewall); gloo's own connections use ephemeral ports on the same interface.
    :param timeout: seconds a lane operation may wait for a groupmate before the round fails; default: a third of
        ``averaging_timeout``.
    """

    host: str = "127.0.0.1"
    port: Union[int, Tuple[int, int]] = 0
    timeout: Optional[float] = None

    def __post_init__(self) -> None:
        if not isinstance(self.host, str):
            raise ConfigTypeError(f"Gloo(host=...) must be an IP address string, e.g. '10.0.0.5', got {self.host!r}")
        address = _ip(self.host)
        if address is None or address.is_unspecified or address.is_multicast:
            raise ConfigError(f"Gloo(host={self.host!r}): name the IP address of the interface the lane should bind "
                              f"to and announce, e.g. Gloo(host='10.0.0.5') (not a hostname, not 0.0.0.0)")
        first, last = self.port if isinstance(self.port, tuple) else (self.port, self.port)
        for value in (first, last):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
                raise ConfigError(f"Gloo(port=...) must be 0 (any free port), a port number or a range "
                                  f"(first, last) of ports in 1-65535, got {self.port!r}")
        if isinstance(self.port, tuple) and (len(self.port) != 2 or not 0 < first <= last):
            raise ConfigError(f"Gloo(port=(first, last)) needs 1 <= first <= last, got {self.port!r}")
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                                         or not (math.isfinite(self.timeout) and self.timeout > 0)):
            raise ConfigError(f"Gloo(timeout=...) must be a positive number of seconds or None, got {self.timeout!r}")

    def listen(self) -> socket.socket:
        """A listening socket for the rendezvous store, on the first free port of ``port``."""
        first, last = self.port if isinstance(self.port, tuple) else (self.port, self.port)
        family = socket.AF_INET6 if _ip(self.host).version == 6 else socket.AF_INET
        error: Optional[OSError] = None
        for port in range(first, last + 1):
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host, port))
                sock.listen(128)
                return sock
            except OSError as e:
                sock.close()
                error = e
        raise ConfigError(f"Gloo: could not listen on {self.host} port(s) {self.port!r} ({error}); pick a free port, "
                          f"a wider range, or port=0")


def lane_codec_dtype(codec: Any) -> torch.dtype:
    """The dtype the lane carries a codec's values in (its ``Compression.lane_dtype``); a codec the lane cannot carry
    is refused (ConfigError)."""
    dtype = codec.lane_dtype
    if dtype is None:
        raise ConfigError(f"transport=Gloo() carries NoCompression(), Float16() and PowerSGD(...) only, got "
                          f"compression={codec!r}; use one of those, or drop transport=Gloo() to average through "
                          f"hivemind")
    return dtype


def lane_key(access: Any) -> bytes:
    """What the lane's store keys derive from: the run secret in a private run, nothing in an open one."""
    if access is None:
        return b""
    tag = access.run.averaging_tag
    if not tag:
        raise ConfigError("transport=Gloo() in a private run needs a run secret (its rendezvous keys derive from it): "
                          "add secret=... to PrivateRun, or drop transport=Gloo()")
    return hmac.new(tag, b"gloo lane", hashlib.sha256).digest()


def lane_addresses(infos: Sequence[dict]) -> Optional[List[Tuple[str, int]]]:
    """Every member's announced lane address, in the group's order; ``None`` unless all announced a valid one."""
    addresses = []
    for info in infos:
        address = _parse_address(info.get(LANE_KEY)) if isinstance(info, dict) else None
        if address is None:
            return None
        addresses.append(address)
    return addresses


def _ip(text: str) -> Optional[Union[ipaddress.IPv4Address, ipaddress.IPv6Address]]:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _parse_address(value: Any) -> Optional[Tuple[str, int]]:
    """A groupmate's ``"host:port"`` (network input: an IP literal and a port, or ``None``)."""
    if not isinstance(value, str) or len(value) > _MAX_ADDRESS_CHARS:
        return None
    host, sep, port = value.rpartition(":")
    address = _ip(host.strip("[]"))
    if not sep or address is None or address.is_unspecified or not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    return str(address), int(port)


class LaneFailure(RuntimeError):
    """A lane round that cannot complete (a groupmate died, stalled or disagreed)."""


class GlooLane:
    """One peer's end of the lane. Built in the host process (it binds the listening socket, so that the address is
    known to announce) before the averager process forks; then started in the process that runs the rounds (the
    host, where the round's tensors are written; PowerSGD's averager process, where its factors are computed), and
    released in the other. The store, the gloo device and the cached process groups live in the process that started
    it."""

    def __init__(self, config: Gloo, *, wire_dtype: torch.dtype, timeout: float, key: bytes, namespace: str,
                 traffic: Any = None) -> None:
        self.config = config
        self.wire_dtype = wire_dtype
        #: where the bytes of completed rounds are counted (``add(sent=, received=)``, in shared memory: read by the
        #: host whichever process runs the rounds); None counts nothing
        self.traffic = traffic
        self.timeout = datetime.timedelta(seconds=config.timeout or timeout)
        self._listener: Optional[socket.socket] = config.listen()
        self.port = self._listener.getsockname()[1]
        host = str(_ip(config.host))
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self.namespace = hashlib.sha256(key + namespace.encode()).hexdigest()[:32]
        self._store: Any = None
        self._device: Any = None
        self._stores: OrderedDict[Tuple[str, int], Any] = OrderedDict()
        self._groups: OrderedDict[Tuple[bytes, ...], Tuple[str, Any]] = OrderedDict()  # -> (token, group)
        self._executor: Optional[ThreadPoolExecutor] = None  # the lane's thread, made at its first use
        self._lock = threading.Lock()

    def release(self) -> None:
        """Close this process's copy of the listening socket: the other process (of the fork) serves it."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def start(self) -> None:
        """Serve the rendezvous store on the listening socket, in this process."""
        from torch.distributed import ProcessGroupGloo, TCPStore

        assert self._listener is not None
        self._store = TCPStore(self.config.host, self.port, None, True, self.timeout, wait_for_workers=False,
                               master_listen_fd=self._listener.fileno(), use_libuv=True)
        self._listener.detach()  # the store owns the socket now, and closes it
        self._listener = None
        self._device = ProcessGroupGloo.create_device(hostname=self.config.host)

    def close(self) -> None:
        with self._lock:
            groups, self._groups = list(self._groups.values()), OrderedDict()
            self._stores.clear()
            self._store = None
        for _, group in groups:
            _abort(group)
        if self._executor is not None:
            self._executor.shutdown(wait=False)  # what it still holds runs (``later``'s chores: nothing waits)

    def drop(self, peer_ids: Sequence[bytes]) -> None:
        """Forget the process group of this membership (its last round failed or was cancelled)."""
        with self._lock:
            entry = self._groups.pop(tuple(sorted(peer_ids)), None)
        if entry is not None:
            _abort(entry[1])

    def submit(self, *args: Any) -> Any:
        """Run ``all_reduce(*args)`` in the lane's thread (a ``concurrent.futures.Future``): for an event loop, which
        must not wait on gloo itself."""
        assert self._store is not None, "start() runs first, in this process"
        with self._lock:
            return self._thread().submit(self.all_reduce, *args)

    def later(self, chore: Callable[..., Any], *args: Any) -> None:
        """Run ``chore(*args)`` in the lane's thread, after what it runs now: for the work after a round that no
        member waits for (deleting its handshake key, telling the averager process's step the verdict), which would
        otherwise add a few tenths of a millisecond to every round. Once closed (no store served), at once."""
        with self._lock:
            if self._store is not None:
                self._thread().submit(chore, *args).add_done_callback(_report_chore)
                return
        chore(*args)

    def _thread(self) -> ThreadPoolExecutor:
        if self._executor is None:  # (under the lock)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gloo_lane")
        return self._executor

    def all_reduce(self, tensors: Sequence[torch.Tensor], peer_ids: Sequence[bytes], own_id: bytes,
                   group_id: bytes, addresses: Sequence[Tuple[str, int]], weight: float, start_timeout: float
                   ) -> Tuple[float, bool]:
        """Replace ``tensors`` with the group's weighted mean, identical on every member; raises ``LaneFailure``
        (the membership's process group is dropped) when the round cannot complete. ``start_timeout``: seconds to
        wait for every member to begin the round. Returns the seconds the round's setup took (the rendezvous, and
        the process group unless it was cached), and whether every value of the mean is finite (anyone's NaN/inf
        poisons the sum: the members need not check what they send)."""
        members = tuple(sorted(peer_ids))
        try:
            # with fp16, one scale per tensor for the whole group (from its largest magnitude): nothing can overflow
            absmax = [_absmax(t) for t in tensors] if self.wire_dtype == torch.float16 else []
            started = time.perf_counter()  # the setup: meeting the group, not the codec's pass over the values
            store = self._rendezvous(addresses[0])
            held, shares = self._group(store, members, members.index(own_id), group_id, start_timeout,
                                       _Share(token="", weight=float(weight), absmax=absmax))
            setup = time.perf_counter() - started
            total = math.fsum(share.weight for share in shares)  # the same sum, in the same order, everywhere
            if not total > 0:
                raise LaneFailure(f"the group's weights sum to {total}")
            scales = [_fp16_scale(max(share.absmax[i] for share in shares)) for i in range(len(tensors))] \
                if absmax else [1.0] * len(tensors)
            # equal weights (every member decides alike, from the same shares): divide after summing, as a plain
            # all-reduce does, in the pass that checks the sum
            equal = len({share.weight for share in shares}) == 1
            finite = self._reduce(held.group, tensors, float(weight) / total, scales, equal)
            if self.traffic is not None:
                moved = ring_bytes(tensors, self.wire_dtype, len(members))
                self.traffic.add(sent=moved, received=moved)
            self.later(held.finish)
            return setup, finite
        except Exception as e:
            self.drop(members)
            if _connection_broke(e):  # else the connection to the host's store serves the next round too
                self._forget_store(addresses[0])
            raise LaneFailure(str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__) from None

    def _rendezvous(self, address: Tuple[str, int]) -> Any:
        """A connection to the store of the member that hosts this round's rendezvous (ours, or a cached one)."""
        from torch.distributed import TCPStore

        if address == (str(_ip(self.config.host)), self.port):
            return self._store
        with self._lock:
            store = self._stores.get(address)
            if store is not None:
                self._stores.move_to_end(address)
                return store
        store = TCPStore(address[0], address[1], None, False, self.timeout, use_libuv=True)
        with self._lock:
            self._stores[address] = store
            while len(self._stores) > _CACHED_STORES:
                self._stores.popitem(last=False)
        return store

    def _forget_store(self, address: Tuple[str, int]) -> None:
        with self._lock:
            self._stores.pop(address, None)

    def _group(self, store: Any, members: Tuple[bytes, ...], rank: int, group_id: bytes, start_timeout: float,
               own: _Share) -> Tuple[_Held, List[_Share]]:
        """The membership's process group, and every member's share of the round. Each member writes under the
        round's key the token of the group it holds, its weight (and largest magnitudes), and reads everyone's: the
        cached group serves if every member holds the same, else a new one is created."""
        from torch.distributed import PrefixStore, ProcessGroupGloo

        round_prefix = f"{self.namespace}/{group_id.hex()}"
        with self._lock:
            token, group = self._groups.get(members, ("", None))
        hello = f"{round_prefix}/hello/{rank}"
        store.set(hello, json.dumps(dict(own._asdict(), token=token)))
        keys = [f"{round_prefix}/hello/{r}" for r in range(len(members))]
        store.wait(keys, datetime.timedelta(seconds=start_timeout))
        shares = [_Share.parse(value, len(own.absmax)) for value in store.multi_get(keys)]
        if group is not None and {share.token for share in shares} == {token}:
            return _Held(group, store, hello), shares
        self.drop(members)
        options = ProcessGroupGloo._Options()
        options._devices = [self._device]
        options._timeout = self.timeout
        group = ProcessGroupGloo(PrefixStore(f"{round_prefix}/pg", store), rank, len(members), options)
        with self._lock:
            self._groups[members] = (group_id.hex(), group)
            while len(self._groups) > _CACHED_GROUPS:
                _abort(self._groups.popitem(last=False)[1][1])
        return _Held(group, store, hello), shares

    def _reduce(self, group: Any, tensors: Sequence[torch.Tensor], share: float, scales: Sequence[float],
                equal: bool) -> bool:
        """Every tensor times this member's share of the group's weight (and its fp16 scale), summed over the group:
        the weighted mean; returns whether it is finite. Large tensors in place when the wire carries their dtype
        (with ``equal`` weights, summed first and then scaled by the share, in the pass that checks them); small
        ones coalesced into one flat buffer."""
        small = [i for i, t in enumerate(tensors) if t.numel() < _SMALL_TENSOR]
        large = [i for i, t in enumerate(tensors) if t.numel() >= _SMALL_TENSOR]
        after = [i for i in large if equal and scales[i] == 1.0 and tensors[i].dtype == self.wire_dtype]
        pending = []
        if small:
            flat = torch.cat([(tensors[i].flatten() * (share * scales[i])).to(self.wire_dtype) for i in small])
            pending.append((small, flat, group.allreduce([flat])))
        for i in large:
            # the buffers are the lane's to overwrite: scaled in place (or after the sum), then sent as they are or
            # cast for the wire
            wire = tensors[i] if i in after else tensors[i].mul_(share * scales[i])
            if wire.dtype != self.wire_dtype:
                wire = wire.to(self.wire_dtype)
            pending.append(([i], wire, group.allreduce([wire])))
        for indices, wire, work in pending:
            work.wait()
            if wire is tensors[indices[0]]:
                continue
            offset = 0
            for i in indices:
                numel = tensors[i].numel()
                tensors[i].copy_(wire.flatten()[offset:offset + numel].view_as(tensors[i]))
                if scales[i] != 1.0:
                    tensors[i].div_(scales[i])
                offset += numel
        finite = scale_and_check([tensors[i] for i in after], share)
        return all_finite([t for i, t in enumerate(tensors) if i not in set(after)]) and finite


def ring_bytes(tensors: Sequence[torch.Tensor], wire_dtype: torch.dtype, members: int) -> int:
    """Bytes one member sends (and as many it receives) when a group of ``members`` all-reduces ``tensors`` on a
    wire of ``wire_dtype`` by a ring (reduce-scatter, then all-gather): 2 (n - 1) / n of the data, as gloo's
    all-reduce moves it. The lane counts this; gloo itself does not report what it sent."""
    size = sum(t.numel() for t in tensors) * torch.finfo(wire_dtype).bits // 8
    return 2 * (members - 1) * size // members


def _absmax(tensor: torch.Tensor) -> float:
    """The largest magnitude in ``tensor``, without a tensor-sized temporary."""
    if not tensor.numel():
        return 0.0
    low, high = torch.aminmax(tensor.detach())
    return max(-float(low), float(high))


def _fp16_scale(absmax: float) -> float:
    """A power of two that brings ``absmax`` into [2^14, 2^15), as ``Float16`` does per tensor."""
    return 1.0 if absmax == 0.0 or not math.isfinite(absmax) else 2.0 ** -min(max(math.frexp(absmax)[1] - 15, -126),
                                                                              113)


class _Share(NamedTuple):
    """What a member tells its group at the start of a lane round: the token of the process group it holds for this
    membership ('' for none), its weight, and with fp16 each tensor's largest magnitude."""

    token: str
    weight: float
    absmax: List[float]

    @classmethod
    def parse(cls, raw: bytes, tensors: int) -> _Share:
        """A groupmate's share, from the store (network input: bounded and checked, or ``LaneFailure``)."""
        try:
            if len(raw) > 160 + 32 * tensors:
                raise ValueError("too long")
            data = json.loads(raw)
            share = cls(token=data["token"], weight=data["weight"], absmax=data["absmax"])
            numbers = [share.weight, *share.absmax] if isinstance(share.absmax, list) else []
            if not (isinstance(share.token, str) and len(share.token) <= 64 and len(numbers) == tensors + 1
                    and all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in numbers)):
                raise ValueError("bad fields")
            return share
        except (ValueError, KeyError, TypeError) as e:
            raise LaneFailure(f"a groupmate's share of the round is malformed ({e})") from None


class _Held:
    """A process group in use for one round, and the handshake key to delete once the round completed (every member
    read it before it could take part in the all-reduce)."""

    def __init__(self, group: Any, store: Any, hello: str) -> None:
        self.group, self._store, self._hello = group, store, hello

    def finish(self) -> None:
        try:
            self._store.delete_key(self._hello)
        except Exception as e:  # the round is complete; a stale key only costs the host a few bytes
            logger.debug("Lane handshake key not deleted: %r", e)


def _connection_broke(error: Exception) -> bool:
    """Whether ``error`` says the connection to a store broke (its host left or restarted), not that a wait timed
    out (the connection stays in order) or a process group failed. Only then is a new connection worth its cost:
    torch looks up the reverse DNS name of both ends of each new store connection, so a slow resolver, or one that
    drops the query, holds it up (5 s, the resolver's timeout, for a dropped one)."""
    from torch.distributed import DistNetworkError

    return isinstance(error, DistNetworkError)


def _report_chore(future: Any) -> None:
    if future.exception() is not None:  # a chore handles what it expects: anything else is a bug
        logger.error("A gloo lane chore failed", exc_info=future.exception())


def _abort(group: Any) -> None:
    try:
        group.abort()
    except Exception as e:
        logger.debug("Aborting a lane process group failed: %r", e)
