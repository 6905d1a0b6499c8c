"""Gradient accumulation maths and the state codec: no network."""

from __future__ import annotations

import pytest
import torch

import swarm_opt
from swarm_opt.buffers import AveragingResult
from swarm_opt.serialization import flatten, unflatten
from swarm_opt.simulation import round_values
from swarm_opt.strategies import GradientAveraging


def _bound(params):
    strategy = GradientAveraging()
    inner = torch.optim.SGD(params, lr=1.0)
    strategy.bind(params, inner)
    return strategy, inner


def test_accumulation_is_weighted_by_samples_not_calls():
    w = torch.nn.Parameter(torch.zeros(3))
    strategy, _ = _bound([w])
    for grad, batch in [(torch.tensor([1.0, 0, 0]), 1), (torch.tensor([0, 3.0, 0]), 3)]:
        w.grad = grad.clone()
        assert strategy.local_step(batch)
    torch.testing.assert_close(round_values(strategy)[0], torch.tensor([0.25, 2.25, 0.0]))
    assert strategy.averaging_weight() == 4.0


def test_non_finite_gradients_are_skipped_and_never_accumulated():
    w = torch.nn.Parameter(torch.zeros(2))
    strategy, _ = _bound([w])
    w.grad = torch.tensor([1.0, float("inf")])
    assert not strategy.local_step(8)
    assert strategy.averaging_weight() == 0 and torch.all(round_values(strategy)[0] == 0)
    w.grad = torch.tensor([2.0, 2.0])
    assert strategy.local_step(2)
    torch.testing.assert_close(round_values(strategy)[0], torch.tensor([2.0, 2.0]))


def test_apply_round_steps_the_inner_optimizer_on_the_average_and_resets():
    w = torch.nn.Parameter(torch.ones(2))
    strategy, _ = _bound([w])
    w.grad = torch.tensor([1.0, 1.0])
    strategy.local_step(4)
    strategy.buffer_templates()[0].copy_(torch.tensor([0.5, -0.5]))  # the running mean, as if averaged
    strategy.apply_round(AveragingResult(peers=(), gathered={}))
    torch.testing.assert_close(w.detach(), torch.tensor([0.5, 1.5]))
    assert w.grad is None and strategy.averaging_weight() == 0


def test_a_parameter_without_gradient_counts_as_zero_gradient():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    strategy, _ = _bound([a, b])
    a.grad, b.grad = torch.ones(1), torch.ones(1)
    strategy.local_step(1)
    a.grad, b.grad = torch.ones(1), None
    strategy.local_step(1)
    torch.testing.assert_close(round_values(strategy)[1], torch.tensor([0.5]))


def test_a_strategy_instance_serves_one_optimizer():
    strategy, _ = _bound([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="pass a new instance"):
        strategy.bind([torch.nn.Parameter(torch.zeros(1))], torch.optim.SGD([torch.zeros(1)], lr=1))


def test_state_codec_round_trips_optimizer_state_without_pickle():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"params": list(model.parameters()), "optimizer": opt.state_dict(), "t": (1, "x", None, True)}
    skeleton, tensors = flatten(state)
    back = unflatten(skeleton, tensors)
    assert back["t"] == (1, "x", None, True)
    assert set(back["optimizer"]["state"]) == {0, 1}  # integer keys survive
    torch.testing.assert_close(back["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("skeleton", [{"__tensor__": 5}, {"__dict__": [[1]]}, {"evil": 1}, {"__dict__": [[[1], 2]]},
                                      b"bytes"])
def test_state_codec_rejects_what_it_did_not_produce(skeleton):
    with pytest.raises(ValueError):
        unflatten(skeleton, [torch.zeros(1)])


def _overlapping(params):
    strategy = GradientAveraging(overlap=swarm_opt.Overlap())
    strategy.bind(params, torch.optim.SGD(params, lr=1.0))
    return strategy


def _steps(strategy, w, grads_and_batches):
    for grad, batch in grads_and_batches:
        w.grad = torch.tensor(grad)
        assert strategy.local_step(batch)


def test_a_held_round_that_fails_is_pooled_with_the_next_one_by_samples():
    w = torch.nn.Parameter(torch.zeros(2))
    strategy = _overlapping([w])
    _steps(strategy, w, [([1.0, 0.0], 2), ([3.0, 0.0], 2)])
    held = strategy.begin_round()
    assert held.weight == 4.0
    buffers = [torch.zeros(2)]
    held.write(buffers)
    torch.testing.assert_close(buffers[0], torch.tensor([2.0, 0.0]))
    _steps(strategy, w, [([0.0, 8.0], 4)])  # the next round accumulates apart
    torch.testing.assert_close(strategy.buffer_templates()[0], torch.tensor([0.0, 8.0]))
    held.give_back()
    torch.testing.assert_close(round_values(strategy)[0], torch.tensor([1.0, 4.0]))  # mean over 8 samples
    assert strategy.averaging_weight() == 8.0 and torch.equal(w.detach(), torch.zeros(2))


def test_a_held_round_that_succeeds_steps_on_the_group_mean_and_keeps_the_next_round():
    w = torch.nn.Parameter(torch.zeros(2))
    strategy = _overlapping([w])
    _steps(strategy, w, [([1.0, 1.0], 2)])
    held = strategy.begin_round()
    _steps(strategy, w, [([5.0, 5.0], 3)])
    held.apply(AveragingResult(peers=(), gathered={}, averaged=[torch.tensor([0.5, -1.0])]))
    torch.testing.assert_close(w.detach(), torch.tensor([-0.5, 1.0]))  # SGD lr 1 on the group's mean
    torch.testing.assert_close(round_values(strategy)[0], torch.tensor([5.0, 5.0]))
    assert strategy.averaging_weight() == 3.0
    again = strategy.begin_round()  # the released buffer is reused, zeroed
    assert again.weight == 3.0 and torch.equal(strategy.buffer_templates()[0], torch.zeros(2))


def test_overlap_is_an_option_object():
    with pytest.raises(TypeError, match="swarm_opt.Overlap"):
        GradientAveraging(overlap=True)


# --- WorkerMomentum: each peer sends its own momentum -----------------------------------------------------------------

def _lsq(rank: int):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)


def _gradient(w: torch.Tensor, rank: int) -> torch.Tensor:
    a, b = _lsq(rank)
    return a.T @ (a @ w - b) / len(b)


def test_worker_momentum_with_the_mean_equals_one_process_with_dampened_momentum():
    """Three peers, equal batches, every peer in every round: the mean of their momenta is the momentum of the mean
    gradient, i.e. one process's SGD(lr, momentum=β, dampening=β) (torch's first step too)."""
    from swarm_opt.simulation import average_in_process

    beta, lr = 0.8, 0.3
    weights = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)) for _ in range(3)]
    strategies = []
    for w in weights:
        strategy = GradientAveraging(momentum=swarm_opt.WorkerMomentum(beta))
        strategy.bind([w], torch.optim.SGD([w], lr=lr))
        strategies.append(strategy)
    single = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    reference = torch.optim.SGD([single], lr=lr, momentum=beta, dampening=beta)
    for _ in range(6):
        for rank, (w, strategy) in enumerate(zip(weights, strategies)):
            for _ in range(2):  # two local steps per round
                w.grad = _gradient(w.detach(), rank)
                assert strategy.local_step(4)
        single.grad = sum(_gradient(single.detach(), rank) for rank in range(3)) / 3
        reference.step()
        average_in_process(strategies)
        for w in weights:
            torch.testing.assert_close(w.detach(), single.detach())


def test_worker_momentum_is_sent_advanced_only_by_a_committed_round_and_kept_in_the_state():
    w = torch.nn.Parameter(torch.zeros(2))
    strategy = GradientAveraging(momentum=swarm_opt.WorkerMomentum(0.5))
    strategy.bind([w], torch.optim.SGD([w], lr=1.0))
    _steps(strategy, w, [([2.0, 0.0], 1)])
    torch.testing.assert_close(round_values(strategy)[0], torch.tensor([2.0, 0.0]))  # first round: the gradient
    assert strategy.state_dict() == {}  # a failed round changed nothing
    strategy.apply_round(AveragingResult(peers=(), gathered={}))  # a round alone: steps on its own momentum
    torch.testing.assert_close(w.detach(), torch.tensor([-2.0, 0.0]))
    _steps(strategy, w, [([0.0, 4.0], 1)])
    torch.testing.assert_close(round_values(strategy)[0], torch.tensor([1.0, 2.0]))  # 0.5·m + 0.5·g
    torch.testing.assert_close(strategy.state_dict()["momentum"][0], torch.tensor([2.0, 0.0]))
    strategy.apply_round(AveragingResult(peers=(), gathered={}, averaged=[torch.tensor([0.0, 1.0])]))
    torch.testing.assert_close(w.detach(), torch.tensor([-2.0, -1.0]))  # the group's aggregate, not its own
    torch.testing.assert_close(strategy.state_dict()["momentum"][0], torch.tensor([1.0, 2.0]))  # its own


def test_worker_momentum_from_a_state_is_checked_and_peers_with_other_momentum_never_meet():
    from swarm_opt.optimizer import model_schema

    w = torch.nn.Parameter(torch.zeros(2))
    strategy = GradientAveraging(momentum=swarm_opt.WorkerMomentum(0.9))
    strategy.bind([w], torch.optim.SGD([w], lr=1.0))
    strategy.load_state_dict({"momentum": [torch.tensor([1.0, 2.0])]})  # a donor's: this peer goes on from it
    _steps(strategy, w, [([11.0, 2.0], 1)])
    torch.testing.assert_close(round_values(strategy)[0], torch.tensor([2.0, 2.0]))
    for bad in ({"momentum": [torch.tensor([float("nan"), 0.0])]}, {"momentum": [torch.zeros(3)]}, {"m": 1}):
        with pytest.raises(swarm_opt.IncompatibleStateError):
            strategy.load_state_dict(bad)
    with pytest.raises(swarm_opt.IncompatibleStateError):  # a peer without momentum takes no momentum
        _bound([torch.nn.Parameter(torch.zeros(2))])[0].load_state_dict({"momentum": [torch.zeros(2)]})
    schemas = {model_schema([w], s.name + s.variant) for s in (
        GradientAveraging(), GradientAveraging(momentum=swarm_opt.WorkerMomentum(0.9)),
        GradientAveraging(momentum=swarm_opt.WorkerMomentum(0.5)), GradientAveraging(overlap=swarm_opt.Overlap()))}
    assert len(schemas) == 3  # overlap changes no maths: it averages with peers without it
