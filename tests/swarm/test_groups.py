"""Moshpit group averaging in a real loopback swarm: four peers in groups of two (a 2 x 2 grid)."""

from __future__ import annotations

import pytest
import torch

from tests.swarm.peer import LSQ_DIM, lsq_problem

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


@pytest.mark.extended  # ~30 s on this machine under load, mostly starting four peers
@pytest.mark.parametrize("strategy", ["local", "diloco", "grad"])
def test_groups_of_two_commit_partial_rounds_and_mix_four_peers_to_one_value(swarm, strategy):
    """Peers start at 0, 1, 2, 3 and do not train (lr 0): only averaging moves them. Rounds average in groups of
    two of the four live peers, along the grid's two dimensions in turn, and commit (a majority of a line of two);
    the peers end at one common value, inside the range they started in. DiLoCo's rounds in groups carry its
    anchors and outer momenta too (with no local progress its outer step only mixes the anchors)."""
    n = 4
    # epochs of ~0.5 s: with ~0.1 s (the other tests' pace) a loaded machine formed groups slower than the epochs
    # went by, and peers out of phase with their line's partner missed half the rounds (spread 0.34 after 12 epochs)
    results = _four_in_groups_of_two(swarm, strategy, lsq_lr=0.0, step_sleep=0.1)
    committed = [rnd for r in results for rnd in r["rounds"] if not rnd["caught_up"]]
    assert len(committed) >= 2 * n, swarm.round_events()
    assert all(rnd["group_size"] == 2 for rnd in committed), committed  # never a group of the whole swarm
    assert sum(rnd["num_peers"] == n for rnd in committed) >= n, committed  # partial by design: 2 of 4 live peers
    finals = torch.stack([r["w"] for r in results])
    assert float(finals.max() - finals.min()) < 1e-2, finals  # one value (from a spread of 3)
    assert 0.0 < float(finals.mean()) < 3.0


@pytest.mark.parametrize("strategy", ["grad", pytest.param("grad_overlap", marks=pytest.mark.extended)])
def test_gradient_averaging_in_groups_leaves_each_group_identical_and_mixes_the_groups(swarm, strategy):
    """Four peers in groups of two that start apart (0, 1, 2, 3: founders that forgot their seed) and train on
    different least-squares problems with gradient averaging: rounds carry the parameters with the gradients, so
    the two members of every committed round leave it with bit-identical parameters while the two groups hold
    different ones (partial rounds), and the next rounds, along the grid's other dimension, mix the groups: the
    peers end close together although each group stepped on its own mean gradient (a simulation of this run ends
    0.5-2.8 apart, peers alone 6.7 apart). With ``Overlap()`` the rounds run while the next gradients are computed
    and are applied at the next step."""
    n = 4
    results = _four_in_groups_of_two(swarm, strategy, lsq_lr=0.05)
    assert all(r["epoch"] >= 12 for r in results), [r["epoch"] for r in results]
    committed = [(r["rank"], rnd) for r in results for rnd in r["rounds"] if not rnd["caught_up"]]
    assert len(committed) >= 2 * n, swarm.round_events()
    assert all(rnd["group_size"] == 2 for _, rnd in committed), committed  # never a group of the whole swarm
    for rank, rnd in committed:
        mates = [other for other, o in committed
                 if other != rank and o["epoch"] == rnd["epoch"] and torch.equal(o["w"], rnd["w"])]
        assert len(mates) == 1, (rank, rnd["epoch"], mates)  # its groupmate, not the other group, holds what it holds
    alone = []  # where each peer would end training on its own problem: at its own optimum, far from the others
    for rank in range(n):
        a, b = lsq_problem(rank)
        w = torch.full((LSQ_DIM,), float(rank), dtype=torch.float64)
        for _ in range(12):
            w = w - 0.05 * a.T @ (a @ w - b)
        alone.append(w)
    finals = torch.stack([r["w"] for r in results])
    assert _spread(finals) < 0.5 * _spread(torch.stack(alone)), (finals, _spread(torch.stack(alone)))
    assert _spread(finals) > 1e-9, "the groups hold different parameters (one group of all would not)"


def _four_in_groups_of_two(swarm, strategy: str, lsq_lr: float, step_sleep: float = 0.02) -> list:
    """Run four least-squares peers that start at 0, 1, 2, 3 for 12 epochs (of 5 steps each, ``step_sleep`` seconds
    apart) in groups of two; their results."""
    for rank in range(4):
        swarm.start(rank, task="lsq", strategy=strategy, groups=2, init_by_rank=True, lsq_lr=lsq_lr, expect_peers=4,
                    batch_size=16, target_batch_size=4 * 16 * 5, epochs=12, step_sleep=step_sleep, matchmaking_time=1.0,
                    averaging_timeout=10.0)
    swarm.wait(timeout=240)
    return [swarm.result(r) for r in range(4)]


def _spread(weights: torch.Tensor) -> float:
    return float((weights.max(0).values - weights.min(0).values).max())
