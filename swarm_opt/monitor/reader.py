"""Watching a run from the outside: read every peer's progress record from the DHT and summarise the swarm.

The one reader of a run that every view sits on (the terminal's ``swarm_opt.monitor.terminal``, the web page's
``swarm_opt.monitor.web``): however many people look, the DHT is read once per refresh. The monitor publishes
nothing. It reads the records ``swarm_opt.progress.ProgressTracker`` publishes (same keys,
same validators, so a record that fails its signature or schema is never shown; in a large swarm, a sample of them
like a trainer's, ``swarm_opt.sharding``) and keeps a history of the global epoch over time for ``--plot``.
The target batch comes from the records (``--target-batch-size`` overrides it). With ``with_stats``, it also reads
the peers' statistics records (``swarm_opt.monitor.stats``: loss, rounds, versions, role) and keeps the histories
the web page charts (``RunHistory``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarm_opt.config import TrackerConfig
from swarm_opt.metrics import Metrics
from swarm_opt.monitor.stats import PeerStats, read_stats, use_stats_records
from swarm_opt.progress import ProgressRecord, SampledRecords, aggregate_progress, progress_key, use_progress_records
from swarm_opt.trust import ClaimChecker


@dataclass(frozen=True)
class PeerView:
    peer_id: str  # base58 libp2p peer id of the peer's DHT node
    epoch: int
    samples: int
    samples_per_second: float
    client_mode: bool
    last_seen: float  # seconds since the record was published
    model_schema: str
    ignored: Optional[str] = None  # why trust ignores this peer's record now (``swarm_opt.trust``), if it does
    stats: Optional[PeerStats] = None  # its statistics record, if it publishes one and the monitor reads them

    @property
    def role(self) -> str:
        if self.stats is not None and self.stats.role == "auxiliary":
            return "auxiliary"
        return "client" if self.client_mode else "trainer"


@dataclass(frozen=True)
class RunSnapshot:
    """The swarm at one moment, as the DHT records describe it."""

    run_id: str
    time: float
    epoch: int
    samples_accumulated: int  # in the global epoch, extrapolated at each peer's throughput
    samples_per_second: float
    peers: Tuple[PeerView, ...]  # in a large swarm, the sample read (each stands for ``scale`` peers)
    target_batch_size: Optional[int] = None
    scale: float = 1.0
    ignored: Tuple[PeerView, ...] = ()  # peers whose records trust ignores now (not counted anywhere)
    helpers: Tuple[PeerView, ...] = ()  # auxiliary peers (they publish statistics, no progress)

    @property
    def num_peers(self) -> int:
        return round(len(self.peers) * self.scale)

    @property
    def num_clients(self) -> int:
        return round(sum(p.client_mode for p in self.peers) * self.scale)

    @property
    def eta_seconds(self) -> Optional[float]:
        if self.target_batch_size is None:
            return None
        missing = max(0, self.target_batch_size - self.samples_accumulated)
        if missing == 0:
            return 0.0
        return missing / self.samples_per_second if self.samples_per_second > 0 else math.inf

    @property
    def fractional_epoch(self) -> float:
        if not self.target_batch_size:
            return float(self.epoch)
        return self.epoch + min(0.99, self.samples_accumulated / self.target_batch_size)


def _peer_name(record: ProgressRecord) -> str:
    return _name(record.peer_id)


def _name(peer_id: bytes) -> str:
    try:
        return PeerID(peer_id).to_base58()
    except Exception:  # a record that passed validation but names no valid peer id
        return peer_id.hex()[:16]


def snapshot_from_records(run_id: str, records: List[ProgressRecord], now: float,
                          target_batch_size: Optional[int] = None, max_extrapolation: float = 0.0,
                          scale: float = 1.0, ahead: Sequence[ProgressRecord] = ()) -> RunSnapshot:
    """The run as ``records`` tell it; ``ahead``: live peers' records listed among the peers but not counted in the
    swarm's epoch and samples."""
    if target_batch_size is None:
        target_batch_size = _common_target(records)
    swarm = aggregate_progress(records, None, target_batch_size or 1, now, max_extrapolation=max_extrapolation,
                               scale=scale)
    peers = tuple(sorted(
        (PeerView(_peer_name(r), r.epoch, r.samples, r.samples_per_second, r.client_mode, max(0.0, now - r.time),
                  r.model_schema) for r in (*records, *ahead)),
        key=lambda p: (p.client_mode, p.peer_id)))
    return RunSnapshot(run_id, now, swarm.epoch, swarm.samples_accumulated, swarm.samples_per_second, peers,
                       target_batch_size, scale)


@dataclass
class RunHistory:
    """What a run did over time, as one monitor saw it: the web page's charts."""

    epochs: Deque[Tuple[float, float, int]] = field(default_factory=lambda: deque(maxlen=4000))  # (time, epoch, peers)
    loss: Dict[int, Dict[bytes, float]] = field(default_factory=dict)  # epoch -> peer -> its mean training loss
    # (minute since the epoch of time.time(), committed, failed): the rounds peers reported, by the minute they did
    rounds: Deque[List[int]] = field(default_factory=lambda: deque(maxlen=24 * 60))
    _last_rounds: Dict[bytes, Dict[str, int]] = field(default_factory=dict)
    # (time, bytes sent per second, received per second): all peers that publish their traffic, together
    traffic: Deque[Tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=4000))
    _last_traffic: Dict[bytes, Tuple[float, int, int]] = field(default_factory=dict)  # peer -> (time, sent, recv)
    _rates: Dict[bytes, Tuple[float, float]] = field(default_factory=dict)  # peer -> its last rates

    max_epochs_kept = 2000

    def add_stats(self, stats: Dict[bytes, PeerStats], now: float) -> None:
        for peer, s in stats.items():
            if s.loss is not None:
                self.loss.setdefault(s.epoch, {})[peer] = s.loss
            before = self._last_rounds.get(peer)
            self._last_rounds[peer] = dict(s.rounds)
            if before is None:  # rounds before this monitor started are not per-minute figures
                continue
            new = {k: max(0, v - before.get(k, 0)) for k, v in s.rounds.items()}
            committed, failed = new.get("committed", 0), new.get("failed", 0)
            if committed or failed:
                minute = int(now // 60)
                if not self.rounds or self.rounds[-1][0] != minute:
                    self.rounds.append([minute, 0, 0])
                self.rounds[-1][1] += committed
                self.rounds[-1][2] += failed
        for gone in [p for p in self._last_rounds if p not in stats]:
            del self._last_rounds[gone]
        self._add_traffic(stats)
        while len(self.loss) > self.max_epochs_kept:
            del self.loss[min(self.loss)]

    def _add_traffic(self, stats: Dict[bytes, PeerStats]) -> None:
        changed = False
        for peer, s in stats.items():
            if s.bytes_sent is None or s.bytes_received is None:
                continue
            before = self._last_traffic.get(peer)
            if before is not None and s.time > before[0]:
                seconds = s.time - before[0]
                self._rates[peer] = (max(0, s.bytes_sent - before[1]) / seconds,
                                     max(0, s.bytes_received - before[2]) / seconds)
                changed = True
            if before is None or s.time > before[0]:
                self._last_traffic[peer] = (s.time, s.bytes_sent, s.bytes_received)
        for gone in [p for p in self._last_traffic if p not in stats]:
            del self._last_traffic[gone]
            self._rates.pop(gone, None)
            changed = True
        if changed:
            self.traffic.append((time.time(), *self.bytes_per_second()))

    def bytes_per_second(self) -> Tuple[float, float]:
        """(sent, received) per second by the peers that publish their traffic, summed: each at its last rate."""
        return sum(r[0] for r in self._rates.values()), sum(r[1] for r in self._rates.values())

    @property
    def publishes_traffic(self) -> bool:
        return bool(self._last_traffic)

    def mean_loss(self) -> List[Tuple[int, float]]:
        return [(epoch, sum(by_peer.values()) / len(by_peer)) for epoch, by_peer in sorted(self.loss.items())]


class _Refusals(Metrics):
    """Which peers the monitor's trust checks ignore, until when, and why."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.refused: Dict[bytes, Tuple[str, float]] = {}  # peer id -> (why, until, monotonic)

    def record_refused(self, reason: str, peer_id: bytes, why: str, seconds: float) -> None:
        with self._lock:
            self.refused[peer_id] = (why, time.monotonic() + seconds)

    def current(self) -> Dict[bytes, str]:
        now = time.monotonic()
        with self._lock:
            for peer in [p for p, (_, until) in self.refused.items() if until <= now]:
                del self.refused[peer]
            return {p: why for p, (why, _) in self.refused.items()}


def _common_target(records: List[ProgressRecord]) -> Optional[int]:
    """The target the peers train with, if they agree on one."""
    return Counter(r.target_batch_size for r in records).most_common(1)[0][0] if records else None


class RunMonitor:
    """Reads a run's progress records through ``dht`` (typically a client-mode node) and keeps their history;
    with ``model_schema``, only the records of the peers that train that model (``Optimizer.model_schema``).
    Samples are shown as reported, unless ``max_extrapolation`` (seconds) lets them grow at each peer's throughput
    since its record, as a trainer's tracker does (see ``aggregate_progress``). ``with_stats``: also read the
    peers' statistics records and keep ``run_history``."""

    def __init__(self, dht: DHT, run_id: str, *, target_batch_size: Optional[int] = None,
                 model_schema: Optional[str] = None, max_extrapolation: float = 0.0, with_stats: bool = False) -> None:
        self.dht, self.run_id, self.target_batch_size = dht, run_id, target_batch_size
        self.max_extrapolation = max_extrapolation
        self.model_schema = model_schema  # only the peers of this model (default: every peer of the run)
        self.key = progress_key(run_id)
        use_progress_records(dht, run_id)
        self.history: List[Tuple[float, float, int]] = []  # (time, fractional epoch, peers)
        self._checker = ClaimChecker()  # liars move the monitor's view no more than a trainer's
        self._refusals = self._checker.metrics = _Refusals()
        self.with_stats = with_stats
        self.run_history = RunHistory()
        if with_stats:
            use_stats_records(dht, run_id)
        self._records = SampledRecords(dht, run_id, model_schema=model_schema,
                                       config=TrackerConfig(max_extrapolation=max_extrapolation))

    def read(self, timeout: float = 10.0) -> RunSnapshot:
        try:
            records, _ = self._records.read(timeout)
        except TimeoutError:  # an unreachable DHT looks like a run with no live peers; the caller says so
            records = []
        stats = read_stats(self.dht, self.run_id, timeout) if self.with_stats else {}
        now = get_dht_time()
        target = self.target_batch_size or _common_target(records)
        checked = self._checker.check(records, None, now, target or 1)
        # a peer one epoch ahead (it committed the round first) is live and listed, but not counted in the epoch
        ahead_keys = checked.live.difference((r.peer_id, r.instance) for r in checked.records)
        ahead = [r for r in records if (r.peer_id, r.instance) in ahead_keys]
        scale = self._records.sample.scale
        snapshot = snapshot_from_records(self.run_id, checked.records, now, self.target_batch_size,
                                         self._records.max_extrapolation, scale, ahead=ahead)
        self._records.sample.observe(scale * (len(checked.records) + len(ahead)))
        if snapshot.peers:
            self.history.append((time.time(), snapshot.fractional_epoch, snapshot.num_peers))
        refused = self._refusals.current()
        ignored = tuple(PeerView(_peer_name(r), r.epoch, r.samples, r.samples_per_second, r.client_mode,
                                 max(0.0, now - r.time), r.model_schema, ignored=refused[r.peer_id])
                        for r in records if r.peer_id in refused)
        if self.with_stats:
            self.run_history.add_stats(stats, time.time())
            epochs = self.run_history.epochs  # a point per change, and one every 15 s (days fit in the deque)
            if snapshot.peers and (not epochs or time.time() - epochs[-1][0] >= 15
                                   or (int(epochs[-1][1]), epochs[-1][2]) != (snapshot.epoch, snapshot.num_peers)):
                epochs.append((time.time(), snapshot.fractional_epoch, snapshot.num_peers))
            by_name = {_name(peer): s for peer, s in stats.items()}
            peers = tuple(replace(p, stats=by_name.get(p.peer_id)) for p in snapshot.peers)
            ignored = tuple(replace(p, stats=by_name.get(p.peer_id)) for p in ignored)
            listed = {p.peer_id for p in peers + ignored}
            helpers = tuple(PeerView(name, s.epoch, 0, 0.0, False, max(0.0, now - s.time), "", stats=s)
                            for name, s in sorted(by_name.items()) if s.role == "auxiliary" and name not in listed)
            snapshot = replace(snapshot, peers=peers, helpers=helpers)
        return replace(snapshot, ignored=ignored) if ignored else snapshot
