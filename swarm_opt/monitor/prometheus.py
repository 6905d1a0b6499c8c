"""Prometheus metrics of one peer (``swarm-opt train|dht --metrics-port PORT``, or ``serve_metrics`` from Python).

Events (rounds by outcome and their duration, records refused by trust) are counted as they happen through the
``swarm_opt.metrics.Metrics`` observer; figures the peer keeps anyway (epoch, peers, throughput, state uploads,
memory of its processes) are read when Prometheus scrapes, so that the training loop pays nothing for them. Each
exporter has a registry of its own: several peers in one process export apart. Needs ``prometheus-client``
(``pip install swarm_opt[monitor]``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Tuple

from swarm_opt.errors import ConfigError
from swarm_opt.metrics import REFUSAL_REASONS, ROUND_OUTCOMES, Metrics

logger = logging.getLogger(__name__)

#: every metric this module exports, with its help text (docs/monitoring.md lists the same)
METRIC_NAMES = {
    "swarm_opt_epoch": "the global epoch this peer's parameters belong to",
    "swarm_opt_peers": "live peers of the run this peer sees (itself included)",
    "swarm_opt_samples_per_second": "the swarm's throughput as this peer sees it",
    "swarm_opt_rounds_total": "this peer's rounds, by outcome (committed, failed, downloaded, skipped)",
    "swarm_opt_round_seconds": "seconds from a round's start to its conclusion (committed or failed)",
    "swarm_opt_state_downloads_served_total": "state downloads this peer served to newcomers",
    "swarm_opt_state_downloads_declined_total": "state downloads this peer declined, busy (the newcomer asked another)",
    "swarm_opt_records_refused_total": "progress records trust started ignoring, by reason",
    "swarm_opt_rounds_helped_total": "rounds an auxiliary peer helped",
    "swarm_opt_bytes_sent_total": "bytes of tensors this peer sent in its all-reduces (hivemind's path and the lane)",
    "swarm_opt_bytes_received_total": "bytes of tensors this peer received in its all-reduces (hivemind's path and "
                                      "the lane)",
    "swarm_opt_averager_resident_memory_bytes": "resident memory of this peer's averager process",
    "swarm_opt_dht_resident_memory_bytes": "resident memory of this peer's DHT process",
    "process_resident_memory_bytes": "resident memory of the trainer's own process (prometheus_client's)",
}


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("--metrics-port needs prometheus-client: pip install swarm_opt[monitor]") from None
    return prometheus_client


def _resident_bytes(pid: Optional[int]) -> float:
    if not pid:
        return float("nan")
    try:
        with open(f"/proc/{pid}/statm") as f:
            import os

            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        try:
            import psutil

            return float(psutil.Process(pid).memory_info().rss)
        except Exception:
            return float("nan")


class PrometheusMetrics(Metrics):
    """A peer's metrics in a registry of their own; ``serve(port)`` exposes them on ``http://HOST:PORT/metrics``.

    :param optimizer: a ``swarm_opt.Optimizer`` (attach the exporter with ``optimizer.observe(metrics)``, or use
        ``serve_metrics``), an ``AuxiliaryPeer``, or None (a DHT node).
    :param dht: the peer's ``hivemind.DHT`` (its process's memory is exported).
    """

    def __init__(self, optimizer: Any = None, dht: Any = None) -> None:
        prometheus = _prometheus()
        self.registry = prometheus.CollectorRegistry(auto_describe=True)
        self._server: Optional[Tuple[Any, Any]] = None
        self.rounds = prometheus.Counter("swarm_opt_rounds", METRIC_NAMES["swarm_opt_rounds_total"], ["outcome"],
                                         registry=self.registry)
        for outcome in ROUND_OUTCOMES:
            self.rounds.labels(outcome)  # every outcome is exported from the start, at 0
        self.round_seconds = prometheus.Histogram(
            "swarm_opt_round_seconds", METRIC_NAMES["swarm_opt_round_seconds"], ["outcome"], registry=self.registry,
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300))
        self.refused = prometheus.Counter("swarm_opt_records_refused", METRIC_NAMES["swarm_opt_records_refused_total"],
                                          ["reason"], registry=self.registry)
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)
        prometheus.ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, cpu seconds, ...
        self.watch(optimizer, dht)

    def watch(self, optimizer: Any = None, dht: Any = None) -> None:
        """Export the figures ``optimizer`` (a ``swarm_opt.Optimizer`` or ``AuxiliaryPeer``) and ``dht`` keep, read
        when scraped (an exporter may start serving before the peer exists, and watch it once it does)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def gauge(name: str, read: Callable[[], float]) -> Tuple[str, Callable[[], Iterable[Any]]]:
            return name, lambda: [GaugeMetricFamily(name, METRIC_NAMES[name], value=read())]

        def counter(name: str, read: Callable[[], float]) -> Tuple[str, Callable[[], Iterable[Any]]]:
            return name, lambda: [CounterMetricFamily(name[:-len("_total")], METRIC_NAMES[name], value=read())]

        pulled = []
        if dht is not None:
            pulled.append(gauge("swarm_opt_dht_resident_memory_bytes", lambda: _resident_bytes(dht.pid)))
        if optimizer is not None and hasattr(optimizer, "progress"):  # a trainer
            pulled += [
                gauge("swarm_opt_epoch", lambda: float(optimizer.local_epoch)),
                gauge("swarm_opt_peers", lambda: float(optimizer.progress.num_peers)),
                gauge("swarm_opt_samples_per_second", lambda: float(optimizer.progress.samples_per_second)),
            ]
        averager = getattr(optimizer, "_averager", None)
        if averager is not None:
            if hasattr(averager, "uploads"):
                pulled += [counter("swarm_opt_state_downloads_served_total", lambda: averager.uploads.served),
                           counter("swarm_opt_state_downloads_declined_total", lambda: averager.uploads.declined)]
            if hasattr(averager, "traffic"):
                pulled += [counter("swarm_opt_bytes_sent_total", lambda: averager.traffic[0]),
                           counter("swarm_opt_bytes_received_total", lambda: averager.traffic[1])]
            pulled.append(gauge("swarm_opt_averager_resident_memory_bytes",
                                lambda: _resident_bytes(averager._engine.pid)))
        if optimizer is not None and hasattr(optimizer, "rounds_helped"):
            pulled.append(counter("swarm_opt_rounds_helped_total", lambda: optimizer.rounds_helped))
        for name, collect in pulled:
            self.registry.register(_Pulled(name, collect))

    def round_concluded(self, outcome: str, seconds: float, group_size: int) -> None:
        self.rounds.labels(outcome).inc()
        if outcome in ("committed", "failed"):
            self.round_seconds.labels(outcome).observe(seconds)

    def record_refused(self, reason: str, peer_id: bytes, why: str, seconds: float) -> None:
        self.refused.labels(reason).inc()

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread (port 0: any free port); returns the port. A port
        in use raises ``ConfigError`` naming it."""
        from prometheus_client import start_http_server

        try:
            self._server = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} ({e.strerror or e}); "
                              f"choose another port") from None
        return int(self._server[0].server_address[1])

    def close(self) -> None:
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            server.server_close()
            thread.join(5)
            self._server = None


class _Pulled:
    """A collector that reads one figure when scraped."""

    def __init__(self, name: str, collect: Callable[[], Iterable[Any]]) -> None:
        self.name, self._collect = name, collect

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        try:
            return list(self._collect())
        except Exception as e:  # a peer shutting down: skip the figure this time
            logger.debug(f"metric {self.name} unavailable: {e!r}")
            return []


def serve_metrics(optimizer: Any, port: int, *, host: str = "0.0.0.0", dht: Any = None) -> PrometheusMetrics:
    """Export ``optimizer``'s metrics (a ``swarm_opt.Optimizer``) on ``http://host:port/metrics``: off unless called.
    Returns the exporter (``close()`` stops serving)."""
    metrics = PrometheusMetrics(optimizer, dht=dht)
    if hasattr(optimizer, "observe"):
        optimizer.observe(metrics)
    metrics.serve(port, host)
    return metrics
