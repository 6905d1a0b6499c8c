"""Watching a run from the outside: read every peer's progress record from the DHT and summarise the swarm.

The monitor publishes nothing. It reads the records ``swarm_opt.progress.ProgressTracker`` publishes (same keys,
same validators, so a record that fails its signature or schema is never shown; in a large swarm, a sample of them
like a trainer's, ``swarm_opt.sharding``) and keeps a history of the global epoch over time for ``--plot``.
The target batch comes from the records (``--target-batch-size`` overrides it).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import List, Optional, Tuple

from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarm_opt.config import TrackerConfig
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
    try:
        return PeerID(record.peer_id).to_base58()
    except Exception:  # a record that passed validation but names no valid peer id
        return record.peer_id.hex()[:16]


def snapshot_from_records(run_id: str, records: List[ProgressRecord], now: float,
                          target_batch_size: Optional[int] = None, max_extrapolation: float = 0.0,
                          scale: float = 1.0) -> RunSnapshot:
    if target_batch_size is None:
        target_batch_size = _common_target(records)
    swarm = aggregate_progress(records, None, target_batch_size or 1, now, max_extrapolation=max_extrapolation,
                               scale=scale)
    peers = tuple(sorted(
        (PeerView(_peer_name(r), r.epoch, r.samples, r.samples_per_second, r.client_mode, max(0.0, now - r.time),
                  r.model_schema) for r in records),
        key=lambda p: (p.client_mode, p.peer_id)))
    return RunSnapshot(run_id, now, swarm.epoch, swarm.samples_accumulated, swarm.samples_per_second, peers,
                       target_batch_size, scale)


def _common_target(records: List[ProgressRecord]) -> Optional[int]:
    """The target the peers train with, if they agree on one."""
    return Counter(r.target_batch_size for r in records).most_common(1)[0][0] if records else None


class RunMonitor:
    """Reads a run's progress records through ``dht`` (typically a client-mode node) and keeps their history;
    with ``model_schema``, only the records of the peers that train that model (``Optimizer.model_schema``).
    Samples are shown as reported, unless ``max_extrapolation`` (seconds) lets them grow at each peer's throughput
    since its record, as a trainer's tracker does (see ``aggregate_progress``)."""

    def __init__(self, dht: DHT, run_id: str, *, target_batch_size: Optional[int] = None,
                 model_schema: Optional[str] = None, max_extrapolation: float = 0.0) -> None:
        self.dht, self.run_id, self.target_batch_size = dht, run_id, target_batch_size
        self.max_extrapolation = max_extrapolation
        self.model_schema = model_schema  # only the peers of this model (default: every peer of the run)
        self.key = progress_key(run_id)
        use_progress_records(dht, run_id)
        self.history: List[Tuple[float, float, int]] = []  # (time, fractional epoch, peers)
        self._checker = ClaimChecker()  # liars move the monitor's view no more than a trainer's
        self._records = SampledRecords(dht, run_id, model_schema=model_schema,
                                       config=TrackerConfig(max_extrapolation=max_extrapolation))

    def read(self, timeout: float = 10.0) -> RunSnapshot:
        try:
            records, _ = self._records.read(timeout)
        except TimeoutError:  # an unreachable DHT looks like a run with no live peers; the caller says so
            records = []
        now = get_dht_time()
        target = self.target_batch_size or _common_target(records)
        records = self._checker.check(records, None, now, target or 1).records
        scale = self._records.sample.scale
        snapshot = snapshot_from_records(self.run_id, records, now, self.target_batch_size,
                                         self._records.max_extrapolation, scale)
        self._records.sample.observe(scale * len(records))
        if snapshot.peers:
            self.history.append((time.time(), snapshot.fractional_epoch, snapshot.num_peers))
        return snapshot


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    if math.isinf(seconds):
        return "unknown (no throughput)"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def format_snapshot(snapshot: RunSnapshot) -> str:
    """A few lines a person can read and a script can grep (``epoch N``, ``peers N``)."""
    lines = [f"run {snapshot.run_id}: epoch {snapshot.epoch}, peers {snapshot.num_peers} "
             f"({snapshot.num_clients} in client mode), {snapshot.samples_per_second:,.0f} samples/s"]
    if snapshot.target_batch_size is not None:
        share = snapshot.samples_accumulated / snapshot.target_batch_size
        status = ("target reached, averaging" if share >= 1 else f"ETA {_duration(snapshot.eta_seconds)}")
        lines.append(f"next epoch: {snapshot.samples_accumulated}/{snapshot.target_batch_size} samples ({share:.0%}), "
                     f"{status}")
    else:
        lines.append(f"next epoch: {snapshot.samples_accumulated} samples so far")
    schemas = {p.model_schema for p in snapshot.peers}
    for peer in snapshot.peers:
        mode = " client" if peer.client_mode else ""
        model = f"  model {peer.model_schema[:8]}" if len(schemas) > 1 else ""
        lines.append(f"  peer {peer.peer_id}  epoch {peer.epoch}  {peer.samples} samples  "
                     f"{peer.samples_per_second:,.0f} samples/s  last seen {peer.last_seen:.1f} s ago{mode}{model}")
    return "\n".join(lines)


def plot_history(history: List[Tuple[float, float, int]], path: str, run_id: str) -> None:
    """Write the run's global epoch over time (and the number of peers) to an image file."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from swarm_opt.errors import ConfigError

        raise ConfigError("--plot needs matplotlib: pip install swarm_opt[cli]") from None
    start = history[0][0]
    seconds = [t - start for t, _, _ in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(seconds, [e for _, e, _ in history], drawstyle="steps-post", label="global epoch")
    ax.set_xlabel("seconds since the monitor started")
    ax.set_ylabel("global epoch")
    ax.set_title(f"run {run_id}")
    peers_ax = ax.twinx()
    peers_ax.plot(seconds, [n for _, _, n in history], color="tab:gray", alpha=0.5, drawstyle="steps-post",
                  label="peers")
    peers_ax.set_ylabel("peers")
    from matplotlib.ticker import MaxNLocator

    peers_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.legend(loc="lower right", bbox_to_anchor=(0.85, 0.2))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
