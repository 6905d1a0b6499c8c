"""Training algorithms, each behind the small ``Strategy`` interface.

``REGISTRY`` is the one table of the strategies a run can name: one row per strategy (its ``Strategy.name``, the
module and class that implement it, a line of help), without importing torch. Everything else is derived from it:
``STRATEGY_NAMES`` (name -> class name: the command line's ``--strategy`` choices and help), ``STRATEGIES`` (name ->
class: the registry the command line, the benchmarks and the conformance tests use), the lazy imports (PEP 562) and
``__all__`` of this package and of ``swarm_opt``. A new strategy is a file, a row here and an entry in
``tests/conformance/test_strategies.py``; what it can do (``dp_safe``, ``supports_groups``, its command-line options)
is declared on its class."""

import importlib
from typing import Any, Dict, List, NamedTuple


class StrategyRow(NamedTuple):
    """One strategy a run can name: ``swarm_opt.strategies.<module>.<cls>``, whose ``Strategy.name`` is ``name``."""

    name: str
    module: str
    cls: str
    help: str


#: the strategies a run can name (``--strategy``), in the order the command line lists them
REGISTRY: List[StrategyRow] = [
    StrategyRow("grad", "grad_averaging", "GradientAveraging", "large-batch gradient averaging"),
    StrategyRow("local", "local_updates", "LocalUpdates", "local SGD (FedAvg)"),
    StrategyRow("fedprox", "local_updates", "FedProx", "local SGD pulled toward the round's start"),
    StrategyRow("scaffold", "scaffold", "Scaffold", "local SGD with control variates (non-IID data)"),
    StrategyRow("diloco", "diloco", "DiLoCo", "local steps, then an outer Nesterov step on the round's change"),
    StrategyRow("fednova", "fednova", "FedNova", "local SGD normalised by each peer's number of steps"),
]

#: the other public names of this package (the base, and the options strategies take): name -> module
HELPERS: Dict[str, str] = {
    "Strategy": "base", "Overlap": "base", "WorkerMomentum": "grad_averaging", "Anchored": "local_updates",
    "AdaptiveMu": "adaptive", "KeepLocal": "partial", "DriftedLayers": "partial", "PeerDP": "peer_dp",
    "AdaptiveClip": "peer_dp",
}


def register(row: StrategyRow) -> None:
    """Add a strategy to the table (a plug-in's, or a test's): it joins ``STRATEGIES``, ``--strategy`` and the
    package's names. Its class must be importable as ``row.module`` (a module of this package, or a full dotted
    path) and its ``name`` must be ``row.name``."""
    if any(known.name == row.name for known in REGISTRY):
        raise ValueError(f"a strategy named {row.name!r} is already registered")
    REGISTRY.append(row)
    _forget_derived()


def unregister(name: str) -> None:
    """Remove a strategy added by ``register`` (tests)."""
    for row in [row for row in REGISTRY if row.name == name]:
        REGISTRY.remove(row)
        globals().pop(row.cls, None)
    _forget_derived()


def strategy_help() -> str:
    """``--strategy``'s help: every registered strategy with its line."""
    return "; ".join(f"{row.name}: {row.help}" for row in REGISTRY)


def public_names() -> List[str]:
    """The names this package (and ``swarm_opt``) exports, derived from the table."""
    return ["Strategy", "STRATEGIES", "STRATEGY_NAMES", *(row.cls for row in REGISTRY),
            *(name for name in HELPERS if name != "Strategy")]


def _module_of(name: str) -> str:
    for row in REGISTRY:
        if row.cls == name:
            return row.module if "." in row.module else f"swarm_opt.strategies.{row.module}"
    return f"swarm_opt.strategies.{HELPERS[name]}"


def _forget_derived() -> None:
    for name in ("STRATEGIES", "STRATEGY_NAMES", "__all__"):
        globals().pop(name, None)


def __getattr__(name: str) -> Any:
    if name == "STRATEGY_NAMES":
        return {row.name: row.cls for row in REGISTRY}
    if name == "__all__":
        return public_names()
    if name == "STRATEGIES":
        value = {row.name: __getattr__(row.cls) for row in REGISTRY}
        mismatched = [key for key, strategy in value.items() if strategy.name != key]
        if mismatched:
            raise ValueError(f"the strategy registry disagrees with Strategy.name for {mismatched}")
        return value
    if name in HELPERS or any(row.cls == name for row in REGISTRY):
        value = getattr(importlib.import_module(_module_of(name)), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'swarm_opt.strategies' has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(public_names()))
