"""Watching a run: one reader of the run's DHT records (``reader``) and the views on top of it: the terminal's
(``terminal``), a live web page (``web``), Prometheus metrics of a peer (``prometheus``), TensorBoard scalars
(``tensorboard``), and the statistics record peers publish for monitors (``stats``).

Only the reader and the terminal view are imported here; the others load their optional dependencies when used.
"""

from swarm_opt.monitor.reader import PeerView, RunHistory, RunMonitor, RunSnapshot, snapshot_from_records
from swarm_opt.monitor.terminal import format_snapshot, plot_history

__all__ = ["PeerView", "RunHistory", "RunMonitor", "RunSnapshot", "format_snapshot", "plot_history",
           "snapshot_from_records"]
