"""Training algorithms, each behind the small ``Strategy`` interface."""

from typing import Dict, Type

from swarm_opt.strategies.base import Strategy
from swarm_opt.strategies.diloco import DiLoCo
from swarm_opt.strategies.grad_averaging import GradientAveraging, Overlap
from swarm_opt.strategies.local_updates import FedProx, LocalUpdates
from swarm_opt.strategies.scaffold import Scaffold

#: every strategy by its ``Strategy.name``: the names the command line, the benchmarks and the conformance tests use
_ALL = (GradientAveraging, LocalUpdates, FedProx, Scaffold, DiLoCo)
STRATEGIES: Dict[str, Type[Strategy]] = {s.name: s for s in _ALL}
assert len(STRATEGIES) == len(_ALL), "two strategies share a name"

__all__ = ["Strategy", "STRATEGIES", "GradientAveraging", "Overlap", "LocalUpdates", "FedProx", "Scaffold", "DiLoCo"]
