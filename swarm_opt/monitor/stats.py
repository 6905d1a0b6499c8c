"""A peer's statistics for the people watching the run: one small signed record per peer, apart from progress.

The progress record (``swarm_opt.progress``) is what trainers read to decide when to average; it stays as small as it
is. What only a monitor needs (the training loss of the peer's last epoch, its rounds by outcome, its software
versions, its role) goes in this second record, under ``{run_id}_peer_stats``, written at most once per global epoch
and once a minute (``StatsPublisher``) and read by monitors only (``read_stats``): trainers never read it, so it costs
a trainer one DHT store per epoch. A monitor reads all of them (O(N) for the monitor, which is one reader).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Dict, List, Optional

import pydantic.v1 as pydantic
from hivemind.dht import DHT
from hivemind.utils import ValueWithExpiration, get_dht_time

from swarm_opt._hivemind.validation import RememberingSchemaValidator, RememberingSignatureValidator, SignedSubkey
from swarm_opt.metrics import ROUND_OUTCOMES, Metrics

logger = logging.getLogger(__name__)

ROLES = ("trainer", "client", "auxiliary")
_REPUBLISH_SECONDS = 60.0  # a record is refreshed at least this often (it expires after 3x)
_MAX_CLOCK_SKEW = 60.0


class PeerStats(pydantic.BaseModel):
    """What one peer says about itself for monitors. Strict types: the DHT schema validator requires them."""

    peer_id: pydantic.StrictBytes
    time: pydantic.StrictFloat
    role: pydantic.constr(max_length=16, strict=True)  # type: ignore[valid-type]  # one of ROLES
    epoch: pydantic.conint(ge=0, strict=True)  # type: ignore[valid-type]
    # the mean training loss of the steps that led to ``epoch`` (None: not reported)
    loss: Optional[pydantic.StrictFloat] = None
    rounds: Dict[pydantic.constr(max_length=16, strict=True),  # type: ignore[valid-type]
                 pydantic.conint(ge=0, strict=True)] = {}  # type: ignore[valid-type]  # outcome -> count
    swarm_opt_version: pydantic.constr(max_length=32, strict=True) = ""  # type: ignore[valid-type]
    hivemind_version: pydantic.constr(max_length=32, strict=True) = ""  # type: ignore[valid-type]
    # bytes of tensor parts sent and received in all-reduces so far (None: not published)
    bytes_sent: Optional[pydantic.conint(ge=0, strict=True)] = None  # type: ignore[valid-type]
    bytes_received: Optional[pydantic.conint(ge=0, strict=True)] = None  # type: ignore[valid-type]
    # the multiaddrs others dial (empty for a client): what ``swarm-opt doctor`` asks a peer to dial back
    maddrs: pydantic.conlist(pydantic.constr(max_length=256, strict=True), max_items=8) = []  # type: ignore

    @pydantic.validator("time", "loss")
    def _finite(cls, value: Optional[float]) -> Optional[float]:  # noqa: N805 (pydantic validators are classmethods)
        if value is not None and not math.isfinite(value):
            raise ValueError("must be finite")
        return value

    @pydantic.validator("rounds")
    def _few(cls, value: dict) -> dict:  # noqa: N805
        if len(value) > 8:
            raise ValueError("at most 8 outcomes")
        return value


class _StatsSchema(pydantic.BaseModel):
    peer_stats: Dict[SignedSubkey, Optional[PeerStats]]


def stats_key(run_id: str) -> str:
    return f"{run_id}_peer_stats"


def use_stats_records(dht: DHT, run_id: str) -> RememberingSignatureValidator:
    """Add the validators of the run's statistics records to ``dht`` (schema and RSA signature); returns the
    signature validator, whose ``local_public_key`` signs this process's records."""
    signature = RememberingSignatureValidator()
    dht.add_validators([RememberingSchemaValidator(_StatsSchema, prefix=run_id), signature])
    return signature


def read_stats(dht: DHT, run_id: str, timeout: float) -> Dict[bytes, PeerStats]:
    """Every live peer's statistics record, by the peer id it names (the newest one of each peer)."""
    try:
        raw = dht.get(stats_key(run_id), latest=True, return_future=True).result(timeout=timeout)
    except Exception:  # an unreachable DHT: no statistics this time
        return {}
    if not isinstance(raw, ValueWithExpiration) or not isinstance(raw.value, dict):
        return {}
    now, found = get_dht_time(), {}
    for entry in raw.value.values():
        value = entry.value if isinstance(entry, ValueWithExpiration) else None
        if value is None:
            continue
        try:
            stats = PeerStats.parse_obj(value)
        except (pydantic.ValidationError, TypeError, ValueError):
            continue
        if stats.time > now + _MAX_CLOCK_SKEW:
            continue
        if stats.peer_id not in found or found[stats.peer_id].time < stats.time:
            found[stats.peer_id] = stats
    return found


def _versions() -> Dict[str, str]:
    import hivemind

    import swarm_opt

    return {"swarm_opt_version": str(swarm_opt.__version__)[:32], "hivemind_version": str(hivemind.__version__)[:32]}


class StatsPublisher(Metrics):
    """Counts this peer's rounds by outcome (attach it with ``Optimizer.observe``) and publishes its statistics
    record: call ``publish(epoch, loss)`` from the training loop (cheap: it stores at most once per epoch or minute,
    without waiting for the DHT)."""

    def __init__(self, dht: DHT, run_id: str, *, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.dht, self.run_id, self.role = dht, run_id, role
        self.rounds: Dict[str, int] = dict.fromkeys(ROUND_OUTCOMES, 0)
        signature = use_stats_records(dht, run_id)
        self._subkey = signature.local_public_key + b"/" + os.urandom(4).hex().encode()
        self._peer_id = dht.peer_id.to_bytes()
        self._maddrs: List[str] = [] if role == "client" else [str(m) for m in dht.get_visible_maddrs()][:8]
        self._versions = _versions()
        self._lock = threading.Lock()
        self._published_epoch: Optional[int] = None
        self._published_at = -math.inf
        self._loss: Optional[float] = None
        self._traffic: Optional[Any] = None

    def watch(self, member: Any) -> None:
        """Publish the traffic of ``member`` (an ``Optimizer`` or ``AuxiliaryPeer``) too."""
        averager = getattr(member, "_averager", None)
        if averager is not None and hasattr(averager, "traffic"):
            self._traffic = lambda: averager.traffic

    def round_concluded(self, outcome: str, seconds: float, group_size: int) -> None:
        with self._lock:
            self.rounds[outcome] = self.rounds.get(outcome, 0) + 1

    def publish(self, epoch: int, loss: Optional[float] = None, *, rounds: Optional[Dict[str, int]] = None) -> None:
        """Publish if the epoch changed or a minute passed. ``loss``: the mean training loss of the steps that led to
        ``epoch`` (kept for the heartbeats of the same epoch); ``rounds``: counts to publish instead of the rounds
        observed (an auxiliary peer's rounds helped)."""
        now = time.monotonic()
        if epoch != self._published_epoch or loss is not None:
            self._loss = None if loss is None or not math.isfinite(loss) else float(loss)
        if epoch == self._published_epoch and now - self._published_at < _REPUBLISH_SECONDS:
            return
        self._published_epoch, self._published_at = epoch, now
        with self._lock:
            counts = dict(self.rounds if rounds is None else rounds)
        sent = received = None
        if self._traffic is not None:
            try:
                sent, received = self._traffic()
            except Exception:  # the averager shutting down
                pass
        record = PeerStats(peer_id=self._peer_id, time=float(get_dht_time()), role=self.role, epoch=int(epoch),
                           loss=self._loss, rounds=counts, maddrs=self._maddrs, bytes_sent=sent,
                           bytes_received=received, **self._versions)
        try:
            self.dht.store(stats_key(self.run_id), subkey=self._subkey, value=record.dict(),
                           expiration_time=get_dht_time() + 3 * _REPUBLISH_SECONDS, return_future=True)
        except Exception as e:  # a DHT shutting down: statistics are a nicety
            logger.debug(f"Could not publish this peer's statistics: {e!r}")

    def withdraw(self) -> None:
        """Remove the record (at shutdown, before the DHT stops), so that monitors stop listing this peer at once."""
        try:
            self.dht.store(stats_key(self.run_id), subkey=self._subkey, value=None,
                           expiration_time=get_dht_time() + 3 * _REPUBLISH_SECONDS, return_future=True
                           ).result(timeout=2.0)
        except Exception as e:
            logger.debug(f"Could not withdraw this peer's statistics: {e!r}")
