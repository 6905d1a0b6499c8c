"""Run averaging rounds inside one process, with the same strategy code a real swarm runs.

For tests of the algorithms' maths and for benchmarks that sweep many settings: ``average_in_process`` does what
a round of ``TensorAverager`` does (a weighted mean written into every member's tensors), without a network.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from swarm_opt.averaging import AveragingResult
from swarm_opt.strategies.base import Strategy


def average_in_process(strategies: Sequence[Strategy], groups: Optional[Sequence[Sequence[int]]] = None) -> None:
    """One round: each group (default: everyone) averages its members' tensors weighted by their
    ``averaging_weight()`` and every member applies the round. A group whose weights are all zero does nothing."""
    groups = [list(range(len(strategies)))] if groups is None else groups
    for group in groups:
        members = [strategies[i] for i in group]
        tensors = [s.tensors_to_average() for s in members]
        weights = [s.averaging_weight() for s in members]
        total = sum(weights)
        if total <= 0:
            continue
        with torch.no_grad():
            for column in zip(*tensors):
                mean = sum(t.detach().to(torch.float64) * (w / total) for t, w in zip(column, weights))
                for t in column:
                    t.copy_(mean)
            result = AveragingResult(peers=tuple(group), gathered={})
            for s in members:
                s.apply_round(result)
