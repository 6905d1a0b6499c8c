"""GradientAveraging in Moshpit groups, on the strategy code itself through swarm_opt.simulation (no network): rounds
carry the parameters and the inner optimizer's statistics, members leave each group identical, and with SGD the
swarm's mean moves as one process on the global batch.

Peers minimise least-squares problems f_i(w) = ½‖A_i w − b_i‖² with full gradients, in float64."""

from __future__ import annotations

import copy

import pytest
import torch

import swarm_opt
from swarm_opt import ConfigError, Groups
from swarm_opt.groups import Grid, grid_shape
from swarm_opt.simulation import moshpit_round
from swarm_opt.strategies import GradientAveraging
from swarm_opt.strategies.base import MAX_ROUNDS_ON_LOCAL_STATE
from tests.unit.test_scaffold_maths import DIM, optimum, problems


def _sgd(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.01)


class Peer:
    """One peer's parameters, inner optimizer and ``GradientAveraging``, in groups of ``size``."""

    def __init__(self, problem, inner=_sgd, size=4, start=None, momentum=None):
        start = torch.zeros(DIM, dtype=torch.float64) if start is None else start
        self.w = torch.nn.Parameter(start.clone())
        self.inner = inner([self.w])
        self.strategy = GradientAveraging(momentum=momentum)
        self.strategy.use_groups(Groups(size=size))
        self.strategy.bind([self.w], self.inner)
        self.a, self.b = problem

    def gradient(self, batch_size=1):
        """Accumulate the full gradient at this peer's parameters as ``batch_size`` samples; return it."""
        self.w.grad = self.a.T @ (self.a @ self.w.detach() - self.b)
        grad = self.w.grad.clone()
        assert self.strategy.local_step(batch_size)
        self.w.grad = None
        return grad

    def state(self):
        return [self.w.detach().clone()] + [t.clone() for t in self.inner.state[self.w].values()]


def _complete_grid(n, size):
    grids = [Grid(size, i) for i in range(n)]
    dims, side = grid_shape(n, size)
    for i, grid in enumerate(grids):
        for j in range(dims):
            grid.coords[j] = (i // side ** j) % side
    return grids


def _mean(tensors, weights):
    return sum(t * w for t, w in zip(tensors, weights)) / sum(weights)


def test_rounds_in_groups_carry_parameters_and_every_optimizer_statistic():
    probs = problems(1)
    sgd = Peer(probs[0])
    adam = Peer(probs[0], inner=lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True))
    assert len(sgd.strategy.buffer_templates()) == 3  # gradients, parameters, momentum buffers
    assert [tuple(t.shape) for t in adam.strategy.buffer_templates()] == [(DIM,)] * 2 + [(), (DIM,), (DIM,), (DIM,)]
    assert sgd.strategy.variant == "+groups" and not sgd.strategy.shares_parameters
    assert not sgd.strategy.sends_changes  # error feedback codecs and PowerSGD are refused (below)
    assert sgd.strategy.keeps_local_state_when_behind(MAX_ROUNDS_ON_LOCAL_STATE)
    assert not sgd.strategy.keeps_local_state_when_behind(MAX_ROUNDS_ON_LOCAL_STATE + 1)
    assert not GradientAveraging().keeps_local_state_when_behind(1)  # one group: never from stale parameters
    with pytest.raises(ConfigError, match="without groups.*groups=None"):
        swarm_opt.PowerSGD(rank=2).check_strategy(sgd.strategy)
    with pytest.raises(ConfigError, match="GradientAveraging\\(\\) or swarm_opt.DiLoCo\\(...\\) without groups"):
        swarm_opt.TopK(0.1).check_strategy(sgd.strategy)


def test_an_optimizer_whose_statistics_cannot_be_probed_is_refused_with_the_fix():
    class NeedsAClosure(torch.optim.SGD):
        def step(self, closure=None):
            if closure is None:
                raise RuntimeError("this optimizer needs a closure")
            return super().step(closure)

    w = torch.nn.Parameter(torch.zeros(3))
    strategy = GradientAveraging()
    strategy.use_groups(Groups(size=4))
    with pytest.raises(ConfigError, match="could not find those of NeedsAClosure.*groups=None"):
        strategy.bind([w], NeedsAClosure([w], lr=0.1))


def test_with_sgd_the_swarms_weighted_mean_moves_as_one_sgd_step_on_the_global_batch():
    """One round on a complete 4 x 4 grid from different parameters and momenta, with different curvatures and
    samples per peer: each group's members leave identical, and the swarm's mean state weighted by the samples is
    exactly one SGD step (Nesterov, weight decay) from the weighted mean state on the weighted mean gradient."""
    n, size = 16, 4
    gen = torch.Generator().manual_seed(5)
    peers = [Peer(p, start=torch.randn(DIM, dtype=torch.float64, generator=gen)) for p in problems(n)]
    grids, ids = _complete_grid(n, size), list(range(n))
    for r in range(3):
        samples = [1 + (i * 7 + r) % 5 for i in range(n)]
        before = [p.state() for p in peers]
        grads = [p.gradient(batch_size=s) for p, s in zip(peers, samples)]
        committed, failed = moshpit_round([p.strategy for p in peers], grids, ids, r)
        assert not failed and len(committed) == size
        for group in committed:
            for i in group[1:]:
                for a, b in zip(peers[i].state(), peers[group[0]].state()):
                    assert torch.equal(a, b)
        ref = torch.nn.Parameter(_mean([b[0] for b in before], samples))
        reference = _sgd([ref])
        if r > 0:
            reference.state[ref]["momentum_buffer"] = _mean([b[1] for b in before], samples)
        ref.grad = _mean(grads, samples)
        reference.step()
        after = [p.state() for p in peers]
        torch.testing.assert_close(_mean([a[0] for a in after], samples), ref.detach(), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(_mean([a[1] for a in after], samples), reference.state[ref]["momentum_buffer"],
                                   atol=1e-12, rtol=1e-12)
        assert max(float((a[0] - ref.detach()).abs().max()) for a in after) > 1e-3, "the groups are not partial"


def test_with_one_curvature_the_swarm_follows_full_batch_sgd_and_the_peers_converge_to_one_point():
    """Peers that forgot their seed (different starts) with one curvature and different optima (the gradient is
    then affine with one matrix, so the mean of the peers' gradients is the gradient at their mean): the swarm's
    mean follows one process of momentum SGD on the whole swarm's loss exactly, and the peers come together at its
    optimum although each group steps on its own mean gradient. The groups' gradients differ at the optimum, so the
    spread they renew each round is proportional to the learning rate: it vanishes as the schedule decays it."""
    n, size = 16, 4
    a = problems(1)[0][0]
    probs = [(a, b) for _, b in problems(n, seed=3)]
    gen = torch.Generator().manual_seed(7)
    peers = [Peer(p, start=torch.randn(DIM, dtype=torch.float64, generator=gen) * 3) for p in probs]
    start = torch.stack([p.w.detach() for p in peers]).mean(0)
    one = torch.nn.Parameter(start.clone())
    process = _sgd([one])
    grids, ids = _complete_grid(n, size), list(range(n))
    spreads = []
    for r in range(400):
        for optimizer in [process] + [p.inner for p in peers]:
            optimizer.param_groups[0]["lr"] = 0.02 / (1 + r / 50)
        for peer in peers:
            peer.gradient()
        committed, failed = moshpit_round([p.strategy for p in peers], grids, ids, r)
        assert not failed
        one.grad = sum(a.T @ (a @ one.detach() - b) for a, b in probs) / n
        process.step()
        stacked = torch.stack([p.w.detach() for p in peers])
        torch.testing.assert_close(stacked.mean(0), one.detach(), atol=1e-9, rtol=1e-9)
        spreads.append(float((stacked - stacked.mean(0)).norm(dim=1).max()))
    target = optimum(probs)
    assert float((one.detach() - target).norm()) < 0.05 * float((start - target).norm())
    assert spreads[0] > 1.0  # peers that started apart and step on different gradients...
    assert spreads[-1] < 0.02 * spreads[0], spreads[::30]  # ...end together (the groups' gradients still differ)
    assert spreads[-1] > 1e-9, "the groups are not partial"


def test_adam_leaves_each_group_identical_and_a_random_grid_with_churn_brings_the_swarm_together():
    """Adam (not linear in its state: no exact mean), 64 peers on random coordinates in groups of 8 (lines fill
    unevenly, some groups fail), a tenth of the peers replaced each round by newcomers holding a survivor's state
    (what a state download gives them): members of every committed group leave bit-identical (peers whose first
    rounds failed have no Adam state yet and take their group's), and the spread shrinks from where different seeds
    put it."""
    n, size = 64, 8
    gen = torch.Generator().manual_seed(11)
    probs = problems(n, seed=2)

    def adam(params):
        return torch.optim.Adam(params, lr=0.01)

    peers = [Peer(p, inner=adam, size=size, start=torch.randn(DIM, dtype=torch.float64, generator=gen) * 3)
             for p in probs]
    ids, next_id = list(range(n)), n
    grids = [Grid(size, i) for i in ids]
    spreads, failures = [], 0
    for r in range(40):
        for peer in peers:
            peer.gradient()
        committed, failed = moshpit_round([p.strategy for p in peers], grids, ids, r)
        failures += len(failed)
        for group in committed:
            for i in group[1:]:
                for x, y in zip(peers[i].state(), peers[group[0]].state()):
                    assert torch.equal(x, y)
        stacked = torch.stack([p.w.detach() for p in peers])
        spreads.append(float((stacked - stacked.mean(0)).norm(dim=1).pow(2).mean().sqrt()))
        for i in torch.randperm(n, generator=gen)[: n // 10].tolist():
            donor = peers[(i + 1) % n]
            peers[i] = Peer(probs[i], inner=adam, size=size, start=donor.w.detach())
            peers[i].inner.load_state_dict(copy.deepcopy(donor.inner.state_dict()))  # torch shares 'step'
            ids[i], grids[i] = next_id, Grid(size, next_id)
            next_id += 1
    assert failures > 0, "a random grid with churn fails some groups"
    assert spreads[-1] < 0.05 * spreads[0], spreads[::5]
