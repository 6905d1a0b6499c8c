"""Training algorithms, each behind the small ``Strategy`` interface.

``STRATEGY_NAMES`` maps each ``Strategy.name`` to its class name without importing torch (the command line lists
them in ``--help``); the classes and ``STRATEGIES`` (name -> class: the registry the command line, the benchmarks and
the conformance tests use) load on first use (PEP 562)."""

import importlib
from typing import TYPE_CHECKING, Any, Dict

if TYPE_CHECKING:
    from swarm_opt.strategies.adaptive import AdaptiveMu
    from swarm_opt.strategies.base import Strategy
    from swarm_opt.strategies.diloco import DiLoCo
    from swarm_opt.strategies.fednova import FedNova
    from swarm_opt.strategies.grad_averaging import GradientAveraging, Overlap, WorkerMomentum
    from swarm_opt.strategies.local_updates import Anchored, FedProx, LocalUpdates
    from swarm_opt.strategies.partial import DriftedLayers, KeepLocal
    from swarm_opt.strategies.peer_dp import AdaptiveClip, PeerDP
    from swarm_opt.strategies.scaffold import Scaffold

STRATEGY_NAMES: Dict[str, str] = {"grad": "GradientAveraging", "local": "LocalUpdates", "fedprox": "FedProx",
                                  "scaffold": "Scaffold", "diloco": "DiLoCo", "fednova": "FedNova"}
_MODULES = {"Strategy": "base", "GradientAveraging": "grad_averaging", "Overlap": "grad_averaging",
            "WorkerMomentum": "grad_averaging",
            "LocalUpdates": "local_updates", "FedProx": "local_updates", "Anchored": "local_updates",
            "Scaffold": "scaffold", "DiLoCo": "diloco", "FedNova": "fednova", "AdaptiveMu": "adaptive",
            "KeepLocal": "partial", "DriftedLayers": "partial", "PeerDP": "peer_dp", "AdaptiveClip": "peer_dp"}


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":
        value = {key: __getattr__(cls) for key, cls in STRATEGY_NAMES.items()}
        mismatched = [key for key, strategy in value.items() if strategy.name != key]
        assert not mismatched, f"STRATEGY_NAMES disagrees with Strategy.name for {mismatched}"
    elif name in _MODULES:
        value = getattr(importlib.import_module(f"swarm_opt.strategies.{_MODULES[name]}"), name)
    else:
        raise AttributeError(f"module 'swarm_opt.strategies' has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = ["Strategy", "STRATEGIES", "STRATEGY_NAMES", "GradientAveraging", "Overlap", "WorkerMomentum", "LocalUpdates",
           "FedProx", "Anchored", "Scaffold", "DiLoCo", "FedNova", "AdaptiveMu", "KeepLocal", "DriftedLayers", "PeerDP",
           "AdaptiveClip"]
