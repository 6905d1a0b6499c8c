"""Run averaging rounds inside one process, with the same strategy code a real swarm runs.

For tests of the algorithms' maths and for benchmarks that sweep many settings: ``average_in_process`` does what
a round of ``TensorAverager`` does (each member writes its buffers, gets the weighted mean), without a network.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from swarm_opt.averaging import AveragingResult, buffer_like
from swarm_opt.strategies.base import Strategy


def average_in_process(strategies: Sequence[Strategy], groups: Optional[Sequence[Sequence[int]]] = None) -> None:
    """One round: each group (default: everyone) averages its members' tensors weighted by their
    ``averaging_weight()`` and every member applies the round. A group whose weights are all zero does nothing."""
    groups = [list(range(len(strategies)))] if groups is None else groups
    for group in groups:
        members = [strategies[i] for i in group]
        weights = [s.averaging_weight() for s in members]
        total = sum(weights)
        if total <= 0:
            continue
        with torch.no_grad():
            buffers = [[buffer_like(t) for t in s.tensors_to_average()] for s in members]
            for s, own in zip(members, buffers):
                s.write_round(own)
            means = [sum(b.to(torch.float64) * (w / total) for b, w in zip(column, weights))
                     for column in zip(*buffers)]
            for s, own in zip(members, buffers):
                for b, mean in zip(own, means):
                    b.copy_(mean)
                s.apply_round(AveragingResult(peers=tuple(group), gathered={}, averaged=tuple(own)))
