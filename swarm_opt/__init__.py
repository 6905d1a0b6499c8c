"""swarm_opt: a peer-to-peer collaborative optimizer for PyTorch, built on hivemind.

The public names are imported on first use (PEP 562): ``import swarm_opt`` loads neither torch nor hivemind, so that
the command line answers ``--help`` at once; ``swarm_opt.Optimizer`` (or ``from swarm_opt import Optimizer``) loads
what it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict, List

from swarm_opt import strategies
from swarm_opt._hivemind.logs import tame_hivemind_logging as tame_hivemind_logging  # re-exported for tests and users
from swarm_opt._hivemind.logs import tame_hivemind_logging_when_imported
from swarm_opt.config import Groups, SwarmConfig, Timeouts, TrackerConfig, TrustConfig
from swarm_opt.errors import (
    CheckpointWriteError,
    ConfigError,
    ConfigTypeError,
    IncompatibleStateError,
    NonFiniteTensorError,
    StateDownloadError,
    SwarmOptError,
)

if TYPE_CHECKING:  # what the lazy names below are, for type checkers and IDEs
    from swarm_opt.aggregation import AGGREGATIONS, Aggregation, Audited, CenteredClip, Mean, Reputation, TrimmedMean
    from swarm_opt.auth import PrivateRun
    from swarm_opt.auxiliary import AuxiliaryPeer
    from swarm_opt.checkpoint import BestLoss, BestMetric, Checkpointer, Latest, ScoredCheckpointer, load_checkpoint
    from swarm_opt.compression import CODECS, Codec, Float16, Int8Blockwise, NoCompression, TopK, Uniform8Bit
    from swarm_opt.compression.powersgd import PowerSGD
    from swarm_opt.gloo_lane import Gloo
    from swarm_opt.offload import Offload
    from swarm_opt.optimizer import Optimizer
    from swarm_opt.privacy import OpacusPrivacy
    from swarm_opt.progress import ProgressTracker, SwarmProgress
    from swarm_opt.ranks import LocalGroup, LocalGroupError
    from swarm_opt.recipe import DataShard, Evaluation, Recipe

__version__ = "0.2.0"

_LAZY: Dict[str, str] = {
    **dict.fromkeys(("AGGREGATIONS", "Aggregation", "Audited", "CenteredClip", "Mean", "Reputation", "TrimmedMean"),
                    "swarm_opt.aggregation"),
    "PrivateRun": "swarm_opt.auth",
    "AuxiliaryPeer": "swarm_opt.auxiliary",
    **dict.fromkeys(("BestLoss", "BestMetric", "Checkpointer", "Latest", "ScoredCheckpointer", "load_checkpoint"),
                    "swarm_opt.checkpoint"),
    **dict.fromkeys(("CODECS", "Codec", "Float16", "Int8Blockwise", "NoCompression", "TopK", "Uniform8Bit"),
                    "swarm_opt.compression"),
    "Gloo": "swarm_opt.gloo_lane",
    "Offload": "swarm_opt.offload",
    "Optimizer": "swarm_opt.optimizer",
    "PowerSGD": "swarm_opt.compression.powersgd",
    "OpacusPrivacy": "swarm_opt.privacy",
    **dict.fromkeys(("ProgressTracker", "SwarmProgress"), "swarm_opt.progress"),
    **dict.fromkeys(("LocalGroup", "LocalGroupError"), "swarm_opt.ranks"),
    **dict.fromkeys(("DataShard", "Evaluation", "Recipe"), "swarm_opt.recipe"),
}
#: the strategies and their options: every name of ``swarm_opt.strategies``' table (``REGISTRY``, ``HELPERS``)
_STRATEGY_NAMES = [name for name in strategies.public_names() if name not in ("STRATEGIES", "STRATEGY_NAMES")]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name) or ("swarm_opt.strategies" if name in strategies.public_names() and name not in
                                 ("STRATEGIES", "STRATEGY_NAMES") else None)
    if module is None:
        raise AttributeError(f"module 'swarm_opt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_STRATEGY_NAMES))


tame_hivemind_logging_when_imported()

__all__ = [
    "Optimizer",
    "AuxiliaryPeer",
    "PrivateRun",
    "Checkpointer",
    "ScoredCheckpointer",
    "BestMetric",
    "BestLoss",
    "Latest",
    "load_checkpoint",
    *_STRATEGY_NAMES,
    "Offload",
    "Gloo",
    "LocalGroup",
    "LocalGroupError",
    "Codec",
    "CODECS",
    "NoCompression",
    "Float16",
    "Int8Blockwise",
    "Uniform8Bit",
    "TopK",
    "PowerSGD",
    "OpacusPrivacy",
    "Aggregation",
    "AGGREGATIONS",
    "Mean",
    "TrimmedMean",
    "CenteredClip",
    "Reputation",
    "Audited",
    "SwarmConfig",
    "Groups",
    "Timeouts",
    "TrackerConfig",
    "TrustConfig",
    "ProgressTracker",
    "SwarmProgress",
    "Recipe",
    "Evaluation",
    "DataShard",
    "SwarmOptError",
    "ConfigError",
    "ConfigTypeError",
    "IncompatibleStateError",
    "CheckpointWriteError",
    "NonFiniteTensorError",
    "StateDownloadError",
    "__version__",
]
