"""TensorBoard scalars of a training peer, one point per global epoch (``swarm-opt train --log-dir DIR``).

The tags are the ones ``swarm_opt.lightning.SwarmCallback`` logs through Lightning's loggers (``swarm/epoch``,
``swarm/peers``, ``swarm/samples_per_second``, ``swarm/grad_norm``), plus what only a global epoch knows: the
training loss of the steps that led to it, the task's test metrics, the round's seconds and group size, and ε where
differential privacy is on. The step of every point is the global epoch. Needs ``tensorboard``
(``pip install swarm_opt[monitor]``).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from swarm_opt.errors import ConfigError

#: tag -> what it holds (docs/monitoring.md lists the same)
TAGS = {
    "train/loss": "mean training loss of this peer's steps in the epoch",
    "test/<metric>": "the task's evaluation after the epoch (test/accuracy, test/loss for the built-in tasks)",
    "swarm/epoch": "the global epoch",
    "swarm/peers": "live peers of the run",
    "swarm/samples_per_second": "the swarm's throughput",
    "swarm/round_seconds": "seconds the epoch's round took (0 when caught up by download)",
    "swarm/group_size": "peers that averaged in the epoch's round",
    "swarm/grad_norm": "with clipping: the gradient norm before clipping",
    "swarm/epsilon": "with differential privacy: the privacy spent so far",
}


class TensorBoardLog:
    """Writes one point per global epoch to ``log_dir`` (created if missing; an unwritable directory raises
    ``ConfigError`` at once, before any training)."""

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("--log-dir needs tensorboard: pip install swarm_opt[monitor]") from None
        path = os.path.expanduser(log_dir)
        try:
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, ".swarm_opt_write_test")
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"--log-dir {log_dir}: cannot write there ({e.strerror or e})") from None
        self.log_dir = path
        self._writer = SummaryWriter(path)

    def log_epoch(self, optimizer: Any, *, loss: Optional[float] = None,
                  test_metrics: Optional[Dict[str, float]] = None) -> None:
        """Log the state of ``optimizer`` (a ``swarm_opt.Optimizer`` that just reached a new global epoch)."""
        epoch = int(optimizer.local_epoch)
        progress = optimizer.progress
        scalars: Dict[str, Optional[float]] = {
            "train/loss": loss,
            "swarm/epoch": float(epoch),
            "swarm/peers": float(progress.num_peers),
            "swarm/samples_per_second": float(progress.samples_per_second),
            "swarm/grad_norm": optimizer.grad_norm,
            "swarm/epsilon": getattr(progress, "epsilon", None),
        }
        report = optimizer.last_round
        if report is not None and report.epoch == epoch:
            scalars["swarm/round_seconds"] = float(report.seconds)
            scalars["swarm/group_size"] = float(report.group_size)
        for name, value in (test_metrics or {}).items():
            scalars[f"test/{name}"] = float(value)
        for tag, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(tag, float(value), global_step=epoch)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
