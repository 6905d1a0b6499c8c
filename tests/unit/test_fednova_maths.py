"""FedNova's normalized averaging on the strategy code itself (no network): heterogeneous least-squares problems
f_i(w) = ½‖A_i w − b_i‖² with full gradients, in float64, peers taking different numbers of local steps."""

from __future__ import annotations

import torch

from swarm_opt.simulation import average_in_process
from swarm_opt.strategies import FedNova, LocalUpdates
from tests.unit.test_scaffold_maths import Peer, optimum, problems

STEPS = [2, 5, 10, 20]  # local steps per round of each peer, every round


def run(strategy_cls, probs, *, lr: float, steps=STEPS, rounds: int = 300) -> torch.Tensor:
    peers = [Peer(strategy_cls(), p, lr=lr) for p in probs]
    for _ in range(rounds):
        for k, peer in zip(steps, peers):
            peer.local_steps(k)
        average_in_process([p.strategy for p in peers])
    for peer in peers[1:]:
        assert torch.equal(peer.w, peers[0].w)  # one model after each round
    return peers[0].w.detach()


def test_with_equal_steps_fednova_is_fedavg():
    probs = problems(4)
    nova = run(FedNova, probs, lr=0.05, steps=[10] * 4, rounds=30)
    fedavg = run(LocalUpdates, probs, lr=0.05, steps=[10] * 4, rounds=30)
    torch.testing.assert_close(nova, fedavg, atol=1e-12, rtol=0)


def test_unequal_steps_fednova_targets_the_true_optimum_where_fedavg_weighs_peers_by_their_steps():
    """FedAvg weighs peer i by its samples (τ_i) and its update grows with τ_i: it settles near the optimum of
    Σ τ_i² f_i. FedNova's fixed point is the optimum of Σ f_i up to the client drift of local steps, O(lr): halving
    the learning rate halves its distance, while FedAvg's stays."""
    probs = problems(4)
    target, speed_weighted = optimum(probs), optimum(probs, [k * k for k in STEPS])
    nova = {lr: (run(FedNova, probs, lr=lr) - target).norm().item() for lr in (0.01, 0.005)}
    fedavg = run(LocalUpdates, probs, lr=0.005)
    fedavg_error = (fedavg - target).norm().item()
    assert nova[0.005] < fedavg_error / 5, (nova, fedavg_error)
    assert nova[0.005] < 0.6 * nova[0.01], nova
    assert (fedavg - speed_weighted).norm().item() < fedavg_error / 10


def test_a_round_alone_keeps_the_local_model():
    (peer,) = [Peer(FedNova(), p, lr=0.05) for p in problems(1)]
    peer.local_steps(7)
    local = peer.w.detach().clone()
    average_in_process([peer.strategy])
    torch.testing.assert_close(peer.w.detach(), local, atol=1e-14, rtol=0)
    torch.testing.assert_close(peer.strategy.anchor.tensors[0], local, atol=1e-14, rtol=0)  # the next round's x
