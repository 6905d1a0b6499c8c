"""FedProx(adaptive=AdaptiveMu()): μ follows the swarm's mean training loss by FL4Health's rule, identically on every
member of a round, through the same round code a real swarm runs (``average_in_process``)."""

from __future__ import annotations

import pytest
import torch

import swarm_opt
from swarm_opt.buffers import AveragingResult
from swarm_opt.simulation import average_in_process
from swarm_opt.strategies.shared_scalars import SharedScalars


def _peer(mu: float = 0.5, **adaptive):
    model = torch.nn.Linear(3, 1)
    strategy = swarm_opt.FedProx(mu=mu, adaptive=swarm_opt.AdaptiveMu(**adaptive))
    strategy.bind(list(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1))
    return model, strategy


def _step(model, strategy, batch: int = 4) -> None:
    model.zero_grad()
    model(torch.ones(batch, 3)).sum().backward()
    assert strategy.local_step(batch)


def test_mu_follows_a_scripted_loss_sequence_identically_on_every_peer():
    peers = [_peer(mu=0.5, delta=0.1, patience=2) for _ in range(3)]
    # each peer's losses are the scripted mean plus its own offset; the offsets cancel in the (equal-weight) mean
    script = [1.0, 0.9, 0.95, 0.8, 0.7, 0.6, 0.5, 0.55, 0.55]
    # by the rule: improve (1 of 2), improve -> -0.1, worse -> +0.1, improve, improve -> -0.1, improve,
    # improve -> -0.1, worse -> +0.1, equal counts as an improvement (1 of 2)
    expected = [0.5, 0.4, 0.5, 0.5, 0.4, 0.4, 0.3, 0.4, 0.4]
    seen = []
    for mean in script:
        for (model, strategy), offset in zip(peers, (-0.2, 0.0, 0.2)):
            for step_offset in (-0.05, 0.05):  # two steps: the peer's mean loss of the round is mean + offset
                _step(model, strategy)
                strategy.observe_loss(mean + offset + step_offset)
        average_in_process([s for _, s in peers])
        mus = {s.mu for _, s in peers}
        assert len(mus) == 1, f"peers disagree on mu: {mus}"
        seen.append(mus.pop())
    assert seen == pytest.approx(expected)


def test_the_group_mean_weights_peers_by_samples_and_ignores_peers_without_a_loss():
    (m1, s1), (m2, s2), (m3, s3) = _peer(delta=0.1, patience=5), _peer(), _peer()
    _step(m1, s1, batch=1)
    s1.observe_loss(4.0)
    _step(m2, s2, batch=3)
    s2.observe_loss(0.0)
    _step(m3, s3, batch=8)  # reports no loss: it must not pull the mean toward 0
    average_in_process([s1, s2, s3])
    assert [s.adaptive.previous_loss for s in (s1, s2, s3)] == pytest.approx([1.0] * 3)  # (1*4 + 3*0) / 4


def test_a_peer_whose_schedule_drifted_ends_a_round_with_the_groups_mu():
    (m1, s1), (m2, s2) = _peer(mu=0.2, patience=3), _peer(mu=0.2, patience=3)
    s2.adaptive.load({"mu": 0.6, "previous_loss": 0.5, "streak": 2})  # e.g. it went on alone for a while
    s2.mu = 0.6
    for model, strategy in ((m1, s1), (m2, s2)):
        _step(model, strategy)
        strategy.observe_loss(1.0)
    average_in_process([s1, s2])
    assert s1.mu == s2.mu and s1.adaptive.state() == s2.adaptive.state()
    # the group's view: mu 0.4, previous loss 0.5 (the only member that had one), then loss 1.0 is worse: + delta
    assert s1.mu == pytest.approx(0.5)


def test_a_round_alone_uses_the_peers_own_loss_and_a_failed_round_keeps_it():
    model, strategy = _peer(mu=0.0, delta=0.25, patience=1)
    _step(model, strategy)
    strategy.observe_loss(2.0)
    begun = strategy.begin_round()
    begun.give_back()  # a failed round: the loss stays for the next one
    begun = strategy.begin_round()
    begun.apply(AveragingResult(peers=(), gathered={}, averaged=None))
    assert strategy.adaptive.previous_loss == 2.0 and strategy.mu == 0.0  # first round improves; floor at 0
    _step(model, strategy)
    strategy.observe_loss(3.0)
    strategy.begin_round().apply(AveragingResult(peers=(), gathered={}, averaged=None))
    assert strategy.mu == 0.25


def test_the_pull_uses_the_adapted_mu():
    model, strategy = _peer(mu=0.0, delta=1.0, patience=5)
    strategy.adaptive.load({"mu": 0.0, "previous_loss": 0.0, "streak": 0})
    _step(model, strategy)
    strategy.observe_loss(1.0)  # worse than 0: mu 0 -> 1
    average_in_process([strategy])
    assert strategy.mu == 1.0
    with torch.no_grad():
        model.weight.add_(1.0)  # y - x = 1 on the weights
    model.zero_grad()
    model.weight.grad = torch.zeros_like(model.weight)
    model.bias.grad = torch.zeros_like(model.bias)
    strategy.before_inner_step()
    torch.testing.assert_close(model.weight.grad, torch.ones_like(model.weight))


def test_hostile_group_values_are_bounded():
    scalars = SharedScalars(swarm_opt.AdaptiveMu.names)
    model, strategy = _peer(mu=0.1, patience=3)
    hostile = torch.tensor([1.0, 5.0, 1.0, -7.0, 1.0, 1e300, 1.0, 1e9], dtype=torch.float64)
    assert scalars.decode(hostile)["mu"] == -7.0
    strategy.adaptive.update(scalars.decode(hostile))
    state = strategy.adaptive.state()
    assert state["mu"] >= 0 and 0 <= state["streak"] < 3
    strategy.adaptive.check(state, "after a hostile round")  # still a state one could save and load


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="delta"):
        swarm_opt.AdaptiveMu(delta=0)
    with pytest.raises(ValueError, match="patience"):
        swarm_opt.AdaptiveMu(patience=0)
    with pytest.raises(TypeError, match="AdaptiveMu"):
        swarm_opt.FedProx(adaptive=True)
    with pytest.raises(ValueError, match="non-negative"):
        swarm_opt.FedProx(mu=float("inf"))
