"""KeepLocal (FedBN, FedPer): which parameters stay on a peer, and rounds that average only the others."""

from __future__ import annotations

import pytest
import torch

import swarm_opt
from swarm_opt.simulation import average_in_process, round_values


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def _fedbn(model: torch.nn.Module) -> swarm_opt.KeepLocal:
    return swarm_opt.KeepLocal(model, lambda name, m: isinstance(m, torch.nn.modules.batchnorm._BatchNorm))


def _peer(seed: int, exchange=_fedbn, strategy=swarm_opt.LocalUpdates, **kwargs):
    model = _model(seed)
    s = strategy(exchange=exchange(model), **kwargs)
    s.bind(list(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return model, s


def _train(model, strategy, seed: int, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g) * (1 + seed)
        model.zero_grad()
        model(x).pow(2).mean().backward()
        assert strategy.local_step(8)


def test_fedbn_keeps_the_normalisation_layers_and_fedper_the_head():
    model = _model(0)
    assert _fedbn(model).names == ["1.weight", "1.bias"]
    assert swarm_opt.KeepLocal(model, lambda name, m: name.startswith("3.")).names == ["3.weight", "3.bias"]


def test_a_round_sends_only_the_shared_parameters_and_averages_them_weighted_by_samples():
    peers = [_peer(seed) for seed in range(3)]
    for (model, s), seed, steps in zip(peers, range(3), (1, 2, 3)):
        _train(model, s, seed, steps)
        with torch.no_grad():
            model[1].weight.fill_(1000.0 + seed)  # a personal value no buffer may hold
    sent = [round_values(s) for _, s in peers]
    for buffers in sent:
        assert [tuple(b.shape) for b in buffers] == [(6, 4), (6,), (2, 6), (2,)]  # no BatchNorm affine (6,)+(6,)
        assert all(b.abs().max() < 1000 for b in buffers)
    weights = [s.averaging_weight() for _, s in peers]
    average_in_process([s for _, s in peers])
    for slot, index in enumerate((0, 1, 4, 5)):  # the shared parameters' positions in model.parameters()
        mean = sum(w * b[slot] for w, b in zip(weights, sent)) / sum(weights)
        for model, _ in peers:
            torch.testing.assert_close(list(model.parameters())[index].detach(), mean)
    for seed, (model, _) in enumerate(peers):
        assert torch.all(model[1].weight == 1000.0 + seed)  # untouched by the round


def test_fedprox_does_not_pull_personal_parameters():
    model, s = _peer(0, strategy=swarm_opt.FedProx, mu=1.0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # every parameter 1 away from the round's start
    model.zero_grad()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    s.before_inner_step()
    assert torch.all(model[0].weight.grad == 1.0) and torch.all(model[1].weight.grad == 0.0)


def test_a_selection_that_keeps_nothing_or_everything_or_another_model_is_refused():
    with pytest.raises(ValueError, match="matched no parameter"):
        _peer(0, exchange=lambda m: swarm_opt.KeepLocal(m, lambda name, mod: name == "typo"))
    with pytest.raises(ValueError, match="nothing would be averaged"):
        _peer(0, exchange=lambda m: swarm_opt.KeepLocal(m, lambda name, mod: True))
    with pytest.raises(ValueError, match="another model"):
        _peer(0, exchange=lambda m: swarm_opt.KeepLocal(_model(1), lambda name, mod: True))
    with pytest.raises(TypeError, match="KeepLocal"):
        swarm_opt.LocalUpdates(exchange="1.weight")


def _drift_peer(threshold: float = 0.1, **kwargs):
    torch.manual_seed(0)  # every peer starts from the same model, as after a round
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    s = swarm_opt.LocalUpdates(select=swarm_opt.DriftedLayers(threshold), **kwargs)
    s.bind(list(model.parameters()), torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9))
    return model, s


def _shift(model, strategy, layers, amount: float, batch: int) -> None:
    """One local step that moves the weights of ``layers`` (indices into the Sequential) by ``amount``."""
    model.zero_grad()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for layer in layers:
        model[layer].weight.grad.fill_(-amount)
    assert strategy.local_step(batch)


def test_peers_sending_different_layers_average_each_over_its_senders():
    peers = [_drift_peer() for _ in range(3)]
    start = [p.detach().clone() for p in peers[0][0].parameters()]
    for (model, s), layers, amount, batch in zip(peers, ([0], [1], [0, 1]), (1.0, 2.0, 3.0), (1, 2, 3)):
        _shift(model, s, layers, amount, batch)
    sent = [round_values(s) for _, s in peers]
    # on the wire: a layer a peer did not send is zeros, and its flag 0 (the flags are the last buffer)
    assert sent[0][-1].tolist() == [1, 0, 0, 0, 0, 0] and torch.all(sent[0][2] == 0)
    assert sent[1][-1].tolist() == [0, 0, 1, 0, 0, 0] and torch.all(sent[1][0] == 0)
    assert sent[2][-1].tolist() == [1, 0, 1, 0, 0, 0]
    ys = [[p.detach().clone() for p in model.parameters()] for model, _ in peers]
    average_in_process([s for _, s in peers])
    layer0 = (1 * ys[0][0] + 3 * ys[2][0]) / 4  # senders 0 and 2, weighted by samples 1 and 3
    layer1 = (2 * ys[1][2] + 3 * ys[2][2]) / 5  # senders 1 and 2
    for model, _ in peers:
        params = list(model.parameters())
        torch.testing.assert_close(params[0].detach(), layer0)
        torch.testing.assert_close(params[2].detach(), layer1)
        torch.testing.assert_close(params[4].detach(), start[4])  # no member moved the last layer: kept as it was


def test_a_layer_below_the_threshold_stays_local_and_the_next_round_measures_from_the_average():
    (m1, s1), (m2, s2) = _drift_peer(threshold=0.5), _drift_peer(threshold=0.5)
    _shift(m1, s1, [0], 1e-3, 1)  # a tiny drift: not sent
    _shift(m2, s2, [0], 10.0, 1)
    small = m1[0].weight.detach().clone()
    average_in_process([s1, s2])
    torch.testing.assert_close(m1[0].weight.detach(), m2[0].weight.detach())  # the only sender's values
    assert not torch.equal(m1[0].weight.detach(), small)
    assert s1.select.flags() == [0.0] * 6  # the round's result is the next round's start


def test_drifted_layers_refuses_peer_dp_and_bad_thresholds():
    with pytest.raises(ValueError, match="privatise"):
        swarm_opt.LocalUpdates(select=swarm_opt.DriftedLayers(), peer_dp=swarm_opt.PeerDP(noise_multiplier=1, clip=1))
    with pytest.raises(ValueError, match="threshold"):
        swarm_opt.DriftedLayers(-1)
    with pytest.raises(TypeError, match="DriftedLayers"):
        swarm_opt.LocalUpdates(select=0.1)


def test_peers_keeping_different_parameters_have_different_model_schemas():
    from swarm_opt.optimizer import model_schema

    params = list(_model(0).parameters())
    assert model_schema(params, "local") == model_schema(params, "local", kept=())
    assert model_schema(params, "local", kept=[2, 3]) != model_schema(params, "local", kept=[4, 5])


def _diloco(**kwargs) -> swarm_opt.DiLoCo:
    return swarm_opt.DiLoCo(lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True), **kwargs)


@pytest.mark.parametrize("strategy", [swarm_opt.Scaffold, swarm_opt.FedNova, _diloco])
def test_strategies_measured_from_x_keep_personal_parameters_out_of_rounds_anchor_and_state(strategy):
    peers = [_peer(0, strategy=strategy) for _ in range(3)]  # the swarm's common x; each peer its own data
    for rnd in range(2):
        for (model, s), seed in zip(peers, range(3)):
            _train(model, s, seed + 10 * rnd)
            if rnd == 1:
                with torch.no_grad():
                    model[1].weight.fill_(1000.0 + seed)  # a personal value no buffer and no state may hold
        for _, s in peers:
            personal = {id(p) for p in s.personal_parameters()}
            assert len(personal) == 2 and not any(id(p) in personal for p in s.anchor.params)  # no x, control, outer
            assert all(b.abs().max() < 1000 for b in round_values(s))
            if isinstance(s, swarm_opt.Scaffold):
                assert [tuple(d.shape) for d in s.controls] == [(6, 4), (6,), (2, 6), (2,)]
        average_in_process([s for _, s in peers])
        for index in (0, 1, 4, 5):  # the shared parameters: one value on every peer
            for model, _ in peers[1:]:
                torch.testing.assert_close(list(model.parameters())[index], list(peers[0][0].parameters())[index])
    for seed, (model, s) in enumerate(peers):
        assert torch.all(model[1].weight == 1000.0 + seed)  # untouched by the round
        assert all(t.abs().max() < 1000 for t in s.anchor.state())
        s.reset()  # after a download: back to the swarm's x, and the personal parameters stay this peer's own
        assert torch.all(model[1].weight == 1000.0 + seed)


@pytest.mark.parametrize("strategy", [swarm_opt.Scaffold, swarm_opt.FedNova, _diloco])
def test_strategies_measured_from_x_refuse_drifted_layers_and_peer_dp(strategy):
    with pytest.raises(ValueError, match="select=DriftedLayers"):
        strategy(select=swarm_opt.DriftedLayers())
    with pytest.raises(ValueError, match="peer_dp=PeerDP"):
        strategy(peer_dp=swarm_opt.PeerDP(noise_multiplier=1.0, clip=1.0))
