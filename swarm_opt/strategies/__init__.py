"""Training algorithms, each behind the small ``Strategy`` interface."""

from swarm_opt.strategies.base import Strategy
from swarm_opt.strategies.grad_averaging import GradientAveraging

__all__ = ["Strategy", "GradientAveraging"]
