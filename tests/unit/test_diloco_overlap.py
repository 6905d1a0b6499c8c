"""``DiLoCo(overlap=Overlap())``: the round's pseudo-gradient is taken when it begins, the inner steps go on while it
averages, and the outer step lands on top of them. Checked against DiLoCo without overlap on the same peers: the
swarm's ``x`` is the same, and no inner step is lost or counted twice."""

from __future__ import annotations

from typing import List

import pytest
import torch

import swarm_opt
from swarm_opt.buffers import AveragingResult, buffer_like

H, K = 5, 3  # inner steps before a round begins, and while it averages


def _outer(p):
    return torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)


class Peer:
    def __init__(self, seed: int, overlap: bool) -> None:
        torch.manual_seed(0)  # every peer starts from the same model
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.strategy = swarm_opt.DiLoCo(_outer, overlap=swarm_opt.Overlap() if overlap else None)
        self.strategy.bind(list(self.model.parameters()), self.inner)
        self.data = torch.Generator().manual_seed(seed)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(8, 4, generator=self.data)
            y = torch.randn(8, 2, generator=self.data)
            self.inner.zero_grad()
            torch.nn.functional.mse_loss(self.model(x), y).backward()
            with torch.no_grad():
                assert self.strategy.local_step(8)

    def params(self) -> List[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _begin(peers):
    """Every peer begins a round and writes its values; returns the rounds and their weighted mean."""
    rounds, sent = [], []
    with torch.no_grad():
        for peer in peers:
            rnd = peer.strategy.begin_round()
            buffers = [buffer_like(t) for t in peer.strategy.buffer_templates()]
            rnd.write(buffers)
            rounds.append(rnd)
            sent.append(buffers)
    total = sum(r.weight for r in rounds)
    mean = [sum(r.weight / total * b[i] for r, b in zip(rounds, sent)) for i in range(len(sent[0]))]
    return rounds, mean


def _apply(rounds, mean) -> None:
    with torch.no_grad():
        for rnd in rounds:
            rnd.apply(AveragingResult(peers=(), gathered={}, averaged=[m.clone() for m in mean]))


def test_the_outer_step_lands_on_the_inner_steps_made_while_the_round_averaged():
    overlapped = [Peer(seed, overlap=True) for seed in (1, 2)]
    blocking = [Peer(seed, overlap=False) for seed in (1, 2)]
    for peer in overlapped + blocking:
        peer.train(H)
    rounds, mean = _begin(overlapped)
    assert all(r.in_background for r in rounds)
    assert [r.weight for r in rounds] == [8.0 * H] * 2
    snapshots = [peer.params() for peer in overlapped]
    for peer in overlapped:
        peer.train(K)  # the round is in flight
    moved = [[now - then for now, then in zip(peer.params(), snap)] for peer, snap in zip(overlapped, snapshots)]
    _apply(rounds, mean)
    blocking_rounds, blocking_mean = _begin(blocking)
    _apply(blocking_rounds, blocking_mean)

    # the swarm's x is what DiLoCo without overlap computes from the same pseudo-gradients
    for peer, reference in zip(overlapped, blocking):
        for x, x_ref in zip(peer.strategy.anchor.tensors, reference.strategy.anchor.tensors):
            torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-6)
    for a, b in zip(overlapped[0].strategy.anchor.tensors, overlapped[1].strategy.anchor.tensors):
        assert torch.equal(a, b)  # every member holds the same x
    # each peer keeps the inner steps it made meanwhile: it stands where x is, moved by them
    for peer, steps in zip(overlapped, moved):
        for p, x, d in zip(peer.params(), peer.strategy.anchor.tensors, steps):
            torch.testing.assert_close(p, x + d, rtol=0, atol=1e-6)
    # and those steps (their samples too) are the next round's: counted once
    assert overlapped[0].strategy.averaging_weight() == 8.0 * K
    rounds, mean = _begin(overlapped)
    for sent, first, second in zip(mean, *moved):  # (equal weights: the plain mean of their changes)
        torch.testing.assert_close(sent, -(first + second) / 2, rtol=0, atol=1e-6)
    _apply(rounds, mean)


def test_a_failed_round_leaves_its_steps_to_the_next_one():
    peer, twin = Peer(1, overlap=True), Peer(1, overlap=False)
    peer.train(H)
    twin.train(H)
    (rnd,), _ = _begin([peer])
    peer.train(K)
    twin.train(K)
    with torch.no_grad():
        rnd.give_back()
    # nothing moved but the inner steps, and the next round sends all H + K of them, as a peer without overlap does
    for a, b in zip(peer.params(), twin.params()):
        assert torch.equal(a, b)
    assert peer.strategy.averaging_weight() == twin.strategy.averaging_weight() == 8.0 * (H + K)
    (rnd,), mean = _begin([peer])
    (_,), twin_mean = _begin([twin])
    for a, b in zip(mean, twin_mean):
        assert torch.equal(a, b)


def test_alone_the_round_is_this_peers_own_outer_step():
    peer, reference = Peer(1, overlap=True), Peer(1, overlap=False)
    peer.train(H)
    reference.train(H)
    (rnd,), _ = _begin([peer])
    (ref,), _ = _begin([reference])
    with torch.no_grad():
        rnd.apply(AveragingResult(peers=(), gathered={}))  # a round alone: no mean, its own values
        ref.apply(AveragingResult(peers=(), gathered={}))
    for x, x_ref in zip(peer.strategy.anchor.tensors, reference.strategy.anchor.tensors):
        torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-6)
    for p, x in zip(peer.params(), peer.strategy.anchor.tensors):
        torch.testing.assert_close(p, x, rtol=0, atol=1e-6)


def test_overlap_with_averaged_optimizer_statistics_is_refused():
    with pytest.raises(swarm_opt.ConfigError, match="average_optimizer_state"):
        swarm_opt.DiLoCo(_outer, overlap=swarm_opt.Overlap(), average_optimizer_state=("exp_avg",))
