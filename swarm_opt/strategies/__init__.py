"""Training algorithms, each behind the small ``Strategy`` interface."""

from swarm_opt.strategies.base import Strategy
from swarm_opt.strategies.diloco import DiLoCo
from swarm_opt.strategies.grad_averaging import GradientAveraging, Overlap
from swarm_opt.strategies.local_updates import FedProx, LocalUpdates
from swarm_opt.strategies.scaffold import Scaffold

__all__ = ["Strategy", "GradientAveraging", "Overlap", "LocalUpdates", "FedProx", "Scaffold", "DiLoCo"]
