"""Run averaging rounds inside one process, with the same strategy code a real swarm runs.

For tests of the algorithms' maths and for benchmarks that sweep many settings: ``average_in_process`` does what
a round of ``TensorAverager`` does (each member begins a round and writes its buffers, gets the weighted mean and
applies it), without a network; ``moshpit_round`` forms the groups of a round of Moshpit averaging as real peers do
(each peer's ``swarm_opt.groups.Grid`` names its line, lines split into groups of at most ``size``, a group commits by
the same rule as ``RoundRunner``). ``round_values`` shows what a strategy would send now.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

import torch

from swarm_opt.buffers import AveragingResult, buffer_like
from swarm_opt.groups import ONE_GROUP, Grid, RoundPlan, line_peers
from swarm_opt.round import is_majority
from swarm_opt.strategies.base import Strategy


def average_in_process(strategies: Sequence[Strategy], groups: Optional[Sequence[Sequence[int]]] = None,
                       plans: Optional[Sequence[RoundPlan]] = None, feedbacks: Optional[Sequence[Any]] = None,
                       round_id: int = 0) -> None:
    """One round: each group (default: everyone) averages its members' values weighted by their rounds' ``weight``
    and every member applies the round. A group whose weights are all zero gives its rounds back. ``plans[i]``: where
    peer ``i`` averages (``Strategy.begin_round``; default: one group). ``feedbacks[i]``: peer ``i``'s codec
    feedback (``TopK``'s ``SparseFeedback``), applied to what it writes as ``TensorAverager`` does, for round
    ``round_id``."""
    groups = [list(range(len(strategies)))] if groups is None else groups
    for group in groups:
        members = [strategies[i] for i in group]
        with torch.no_grad():
            rounds = [s.begin_round(ONE_GROUP if plans is None else plans[i]) for s, i in zip(members, group)]
            weights = [r.weight for r in rounds]
            total = sum(weights)
            if total <= 0:
                for r in rounds:
                    r.give_back()
                continue
            buffers = [[buffer_like(t) for t in s.buffer_templates()] for s in members]
            for r, own, i in zip(rounds, buffers, group):
                r.write(own)
                if feedbacks is not None:
                    feedbacks[i].select(own, r.weight, round_id)
            means = [sum(b.to(torch.float64) * (w / total) for b, w in zip(column, weights))
                     for column in zip(*buffers)]
            for r, own in zip(rounds, buffers):
                for b, mean in zip(own, means):
                    b.copy_(mean)
                r.apply(AveragingResult(peers=tuple(group), gathered={}, averaged=tuple(own)))
            for i in group if feedbacks is not None else ():
                feedbacks[i].commit(round_id, averaged=True)


def moshpit_groups(grids: Sequence[Grid], ids: Sequence[Any], round_id: int, num_peers: Optional[int] = None
                   ) -> Tuple[List[RoundPlan], List[List[int]], List[List[int]]]:
    """The groups of round ``round_id`` among peers ``ids`` (``num_peers`` live, default all of them), each on its
    ``Grid``: ``(plans, committing groups, failing groups)``, groups as lists of indices. A line splits into groups of
    at most ``Grid.size`` in the order of ``ids`` (matchmaking's order is as arbitrary)."""
    num_peers = len(ids) if num_peers is None else num_peers
    size = grids[0].size if grids else None
    plans = [grid.plan(round_id, num_peers) for grid in grids]
    lines: Dict[Tuple[int, int, str], List[int]] = defaultdict(list)
    for i, plan in enumerate(plans):
        lines[(plan.dims, plan.dimension, plan.cell)].append(i)
    step = size or max(1, len(ids))
    groups, commits = [], []
    for line in lines.values():
        for start in range(0, len(line), step):
            group = line[start:start + step]
            groups.append(group)  # its leader counts the whole line: every member declared under the line's key
            line_size = line_peers(num_peers, plans[group[0]], len(line), len(group))
            # a peer alone in its line finds no group (hivemind's groups hold two or more)
            commits.append(is_majority(len(group), line_size) and (len(group) > 1 or plans[group[0]].whole_swarm))
    return plans, [g for g, c in zip(groups, commits) if c], [g for g, c in zip(groups, commits) if not c]


def moshpit_round(strategies: Sequence[Strategy], grids: Sequence[Grid], ids: Sequence[Any], round_id: int,
                  absent: Collection[int] = ()) -> Tuple[List[List[int]], List[List[int]]]:
    """One round of Moshpit averaging in process (``moshpit_groups``): committing groups average and their members
    move on the grid, as ``RoundRunner`` does; failing groups change nothing but their grid coordinates. Peers at
    the indices ``absent`` miss the round (too late for their group, as peers of a loaded swarm are): they count as
    live but join no group, so they fail it. Returns (committed, failed) groups."""
    present = [i for i in range(len(ids)) if i not in absent]
    present_plans, committing, failing = moshpit_groups([grids[i] for i in present], [ids[i] for i in present],
                                                        round_id, num_peers=len(ids))
    plans = [grid.plan(round_id, len(ids)) for grid in grids]  # the present peers' plans as moshpit_groups made them
    for i, plan in zip(present, present_plans):
        plans[i] = plan
    committing = [[present[i] for i in group] for group in committing]
    failing = [[present[i] for i in group] for group in failing] + [[i] for i in sorted(absent)]
    average_in_process(strategies, committing, plans)
    for group in committing:
        members = [ids[i] for i in group]
        for i in group:
            grids[i].moved(plans[i], members, ids[i], round_id)
    for group in failing:
        for i in group:
            grids[i].missed(plans[i], round_id)
    return committing, failing


def round_values(strategy: Strategy) -> List[torch.Tensor]:
    """The values ``strategy`` would send in a round now (a round begun, written and given back)."""
    with torch.no_grad():
        begun = strategy.begin_round()
        buffers = [buffer_like(t) for t in strategy.buffer_templates()]
        begun.write(buffers)
        begun.give_back()
    return buffers
