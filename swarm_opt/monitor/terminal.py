"""The terminal's view of a run: a few lines per snapshot (``swarm-opt monitor``), and a PNG of the global epoch over
time when it stops (``--plot``)."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

from swarm_opt.monitor.reader import RunSnapshot


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
    for peer in snapshot.ignored:
        lines.append(f"  ignored peer {peer.peer_id}  epoch {peer.epoch}: {peer.ignored}")
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
