"""swarm_opt: a peer-to-peer collaborative optimizer for PyTorch, built on hivemind."""

from swarm_opt._logging import tame_hivemind_logging
from swarm_opt.auth import PrivateRun
from swarm_opt.auxiliary import AuxiliaryPeer
from swarm_opt.checkpoint import BestMetric, Checkpointer, load_checkpoint
from swarm_opt.compression import CODECS, Codec, Float16, Int8Blockwise, NoCompression, Uniform8Bit
from swarm_opt.config import SwarmConfig, Timeouts, TrackerConfig, TrustConfig
from swarm_opt.errors import (
    ConfigError,
    ConfigTypeError,
    IncompatibleStateError,
    NonFiniteTensorError,
    StateDownloadError,
    SwarmOptError,
)
from swarm_opt.gloo_lane import Gloo
from swarm_opt.offload import Offload
from swarm_opt.optimizer import Optimizer
from swarm_opt.powersgd import PowerSGD
from swarm_opt.progress import ProgressTracker, SwarmProgress
from swarm_opt.strategies import DiLoCo, FedProx, GradientAveraging, LocalUpdates, Overlap, Scaffold, Strategy

__version__ = "0.1.0"

tame_hivemind_logging()

__all__ = [
    "Optimizer",
    "AuxiliaryPeer",
    "PrivateRun",
    "Checkpointer",
    "BestMetric",
    "load_checkpoint",
    "GradientAveraging",
    "Overlap",
    "LocalUpdates",
    "FedProx",
    "Scaffold",
    "DiLoCo",
    "Strategy",
    "Offload",
    "Gloo",
    "Codec",
    "CODECS",
    "NoCompression",
    "Float16",
    "Int8Blockwise",
    "Uniform8Bit",
    "PowerSGD",
    "SwarmConfig",
    "Timeouts",
    "TrackerConfig",
    "TrustConfig",
    "ProgressTracker",
    "SwarmProgress",
    "SwarmOptError",
    "ConfigError",
    "ConfigTypeError",
    "IncompatibleStateError",
    "NonFiniteTensorError",
    "StateDownloadError",
    "__version__",
]
