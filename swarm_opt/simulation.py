"""Run averaging rounds inside one process, with the same strategy code a real swarm runs.

For tests of the algorithms' maths and for benchmarks that sweep many settings: ``average_in_process`` does what
a round of ``TensorAverager`` does (each member begins a round and writes its buffers, gets the weighted mean and
applies it), without a network. ``round_values`` shows what a strategy would send now.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from swarm_opt.buffers import AveragingResult, buffer_like
from swarm_opt.strategies.base import Strategy


def average_in_process(strategies: Sequence[Strategy], groups: Optional[Sequence[Sequence[int]]] = None) -> None:
    """One round: each group (default: everyone) averages its members' values weighted by their rounds' ``weight``
    and every member applies the round. A group whose weights are all zero gives its rounds back."""
    groups = [list(range(len(strategies)))] if groups is None else groups
    for group in groups:
        members = [strategies[i] for i in group]
        with torch.no_grad():
            rounds = [s.begin_round() for s in members]
            weights = [r.weight for r in rounds]
            total = sum(weights)
            if total <= 0:
                for r in rounds:
                    r.give_back()
                continue
            buffers = [[buffer_like(t) for t in s.buffer_templates()] for s in members]
            for r, own in zip(rounds, buffers):
                r.write(own)
            means = [sum(b.to(torch.float64) * (w / total) for b, w in zip(column, weights))
                     for column in zip(*buffers)]
            for r, own in zip(rounds, buffers):
                for b, mean in zip(own, means):
                    b.copy_(mean)
                r.apply(AveragingResult(peers=tuple(group), gathered={}, averaged=tuple(own)))


def round_values(strategy: Strategy) -> List[torch.Tensor]:
    """The values ``strategy`` would send in a round now (a round begun, written and given back)."""
    with torch.no_grad():
        begun = strategy.begin_round()
        buffers = [buffer_like(t) for t in strategy.buffer_templates()]
        begun.write(buffers)
        begun.give_back()
    return buffers
