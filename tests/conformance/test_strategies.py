"""Every strategy through the same checks: one registry, one file (as torch's optim_db does for optimizers).

Entries are keyed by ``Strategy.name`` (the keys of ``swarm_opt.strategies.STRATEGIES``), ``name+variant`` for a
variant of one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, List

import pytest
import torch

import swarm_opt
from swarm_opt.buffers import buffer_like
from swarm_opt.clipping import GradNormClipping
from swarm_opt.simulation import average_in_process, round_values


@dataclass(frozen=True)
class StrategyInfo:
    make: Callable[..., swarm_opt.Strategy]  # make() or, with needs_model, make(model)
    inner: Callable = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    bad_arguments: tuple = ()  # (callable that must raise, exception type, message regex)
    needs_model: bool = False  # make takes the model (KeepLocal names its parameters)

    def build(self, model: torch.nn.Module) -> swarm_opt.Strategy:
        return self.make(model) if self.needs_model else self.make()


def _in_groups(strategy: swarm_opt.Strategy) -> swarm_opt.Strategy:
    """``strategy`` as ``Optimizer(groups=Groups(size=4))`` makes it (before binding)."""
    strategy.use_groups(swarm_opt.Groups(size=4))
    return strategy


def _outer(p):
    return torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)


STRATEGIES = {
    "grad": StrategyInfo(swarm_opt.GradientAveraging),
    "grad+overlap": StrategyInfo(
        lambda: swarm_opt.GradientAveraging(overlap=swarm_opt.Overlap()),
        bad_arguments=((lambda: swarm_opt.GradientAveraging(overlap=True), TypeError, "Overlap"),)),
    "grad+momentum": StrategyInfo(
        lambda: swarm_opt.GradientAveraging(momentum=swarm_opt.WorkerMomentum(0.9)),
        inner=lambda p: torch.optim.SGD(p, lr=0.5),
        bad_arguments=((lambda: swarm_opt.GradientAveraging(momentum=0.9), TypeError, "WorkerMomentum"),
                       (lambda: swarm_opt.WorkerMomentum(1.0), ValueError, r"\[0, 1\)"))),
    "grad+momentum+overlap": StrategyInfo(
        lambda: swarm_opt.GradientAveraging(momentum=swarm_opt.WorkerMomentum(0.5), overlap=swarm_opt.Overlap()),
        inner=lambda p: torch.optim.SGD(p, lr=0.5)),
    "grad+groups": StrategyInfo(lambda: _in_groups(swarm_opt.GradientAveraging())),
    "grad+groups+overlap+momentum": StrategyInfo(  # Adam's statistics (a scalar step among them) in the rounds
        lambda: _in_groups(swarm_opt.GradientAveraging(overlap=swarm_opt.Overlap(),
                                                       momentum=swarm_opt.WorkerMomentum(0.5))),
        inner=lambda p: torch.optim.Adam(p, lr=0.01)),
    "local": StrategyInfo(
        lambda: swarm_opt.LocalUpdates(average_optimizer_state=("momentum_buffer",)),
        bad_arguments=((lambda: swarm_opt.LocalUpdates(average_optimizer_state="exp_avg"), TypeError, "sequence"),)),
    "fedprox": StrategyInfo(
        lambda: swarm_opt.FedProx(mu=0.1),
        bad_arguments=((lambda: swarm_opt.FedProx(mu=-1), ValueError, "non-negative"),)),
    "local+keep_local": StrategyInfo(  # FedPer: the last layer stays on each peer
        lambda model: swarm_opt.LocalUpdates(exchange=swarm_opt.KeepLocal(model, lambda n, m: n.startswith("2."))),
        needs_model=True,
        bad_arguments=((lambda: swarm_opt.LocalUpdates(exchange=lambda n, m: True), TypeError, "KeepLocal"),
                       (lambda: swarm_opt.KeepLocal(torch.nn.Linear(2, 2), "bias"), TypeError, "function"))),
    "local+drifted": StrategyInfo(
        lambda: swarm_opt.LocalUpdates(select=swarm_opt.DriftedLayers(0.0),
                                       average_optimizer_state=("momentum_buffer",)),
        bad_arguments=((lambda: swarm_opt.DriftedLayers(threshold="0.1"), ValueError, "threshold"),)),
    "local+peer_dp": StrategyInfo(  # without noise (random: a peer and its twin would send different values)
        lambda: swarm_opt.LocalUpdates(peer_dp=swarm_opt.PeerDP(
            noise_multiplier=0.0, clip=swarm_opt.AdaptiveClip(0.5, target_quantile=0.5), split=3)),
        bad_arguments=((lambda: swarm_opt.PeerDP(noise_multiplier=1.0, clip=0), TypeError, "positive"),
                       (lambda: swarm_opt.AdaptiveClip(1.0, target_quantile=2), ValueError, "target_quantile"),
                       (lambda: swarm_opt.LocalUpdates(average_optimizer_state=("momentum_buffer",),
                                                       peer_dp=swarm_opt.PeerDP(noise_multiplier=1.0, clip=1.0)),
                        ValueError, "average_optimizer_state"))),
    "fedprox+keep_local_peer_dp_adaptive": StrategyInfo(  # every option at once: their round slots must not clash
        lambda model: swarm_opt.FedProx(
            mu=0.1, adaptive=swarm_opt.AdaptiveMu(patience=2),
            exchange=swarm_opt.KeepLocal(model, lambda n, m: n.startswith("0.")),
            peer_dp=swarm_opt.PeerDP(noise_multiplier=0.0, clip=swarm_opt.AdaptiveClip(1.0))),
        needs_model=True),
    "fedprox+adaptive": StrategyInfo(
        lambda: swarm_opt.FedProx(mu=0.1, adaptive=swarm_opt.AdaptiveMu(delta=0.05, patience=2)),
        bad_arguments=((lambda: swarm_opt.FedProx(adaptive=0.1), TypeError, "AdaptiveMu"),
                       (lambda: swarm_opt.AdaptiveMu(patience=1.5), ValueError, "patience"))),
    "scaffold": StrategyInfo(
        swarm_opt.Scaffold,
        bad_arguments=((lambda: swarm_opt.Scaffold().bind([torch.nn.Parameter(torch.zeros(1))],
                                                          torch.optim.Adam([torch.zeros(1)])), ValueError, "SGD"),)),
    "diloco": StrategyInfo(
        lambda: swarm_opt.DiLoCo(outer_optimizer=_outer),
        inner=lambda p: torch.optim.AdamW(p, lr=0.01),
        bad_arguments=((lambda: swarm_opt.DiLoCo(outer_optimizer=torch.optim.SGD([torch.zeros(1)], lr=1)),
                        TypeError, "factory"),)),
    "diloco+overlap": StrategyInfo(
        lambda: swarm_opt.DiLoCo(outer_optimizer=_outer, overlap=swarm_opt.Overlap()),
        inner=lambda p: torch.optim.AdamW(p, lr=0.01),
        bad_arguments=((lambda: swarm_opt.DiLoCo(_outer, overlap=True), TypeError, "Overlap"),
                       (lambda: swarm_opt.DiLoCo(_outer, overlap=swarm_opt.Overlap(),
                                                 average_optimizer_state=("exp_avg",)), ValueError,
                        "average_optimizer_state"))),
    "diloco+groups+overlap": StrategyInfo(
        lambda: _in_groups(swarm_opt.DiLoCo(outer_optimizer=_outer, overlap=swarm_opt.Overlap())),
        inner=lambda p: torch.optim.AdamW(p, lr=0.01)),
    "fednova": StrategyInfo(
        lambda: swarm_opt.FedNova(average_optimizer_state=("momentum_buffer",)),
        bad_arguments=((lambda: swarm_opt.FedNova(average_optimizer_state=[1]), TypeError, "sequence"),)),
    # the strategies measured from the swarm's x: KeepLocal's parameters stay out of x, the controls, the outer step
    "scaffold+keep_local": StrategyInfo(
        lambda model: swarm_opt.Scaffold(exchange=swarm_opt.KeepLocal(model, lambda n, m: n.startswith("2."))),
        needs_model=True,
        bad_arguments=((lambda: swarm_opt.Scaffold(select=swarm_opt.DriftedLayers()), ValueError,
                        "select=DriftedLayers"),
                       (lambda: swarm_opt.Scaffold(peer_dp=swarm_opt.PeerDP(noise_multiplier=1.0, clip=1.0)),
                        ValueError, "peer_dp=PeerDP"))),
    "fednova+keep_local": StrategyInfo(
        lambda model: swarm_opt.FedNova(exchange=swarm_opt.KeepLocal(model, lambda n, m: n.startswith("0.")),
                                        average_optimizer_state=("momentum_buffer",)),
        needs_model=True,
        bad_arguments=((lambda: swarm_opt.FedNova(select=swarm_opt.DriftedLayers()), ValueError,
                        "select=DriftedLayers"),
                       (lambda: swarm_opt.FedNova(peer_dp=swarm_opt.PeerDP(noise_multiplier=1.0, clip=1.0)),
                        ValueError, "peer_dp=PeerDP"))),
    "diloco+keep_local": StrategyInfo(
        lambda model: swarm_opt.DiLoCo(outer_optimizer=_outer,
                                       exchange=swarm_opt.KeepLocal(model, lambda n, m: n.startswith("2."))),
        inner=lambda p: torch.optim.AdamW(p, lr=0.01), needs_model=True,
        bad_arguments=((lambda: swarm_opt.DiLoCo(_outer, select=swarm_opt.DriftedLayers()), ValueError,
                        "select=DriftedLayers"),
                       (lambda: swarm_opt.DiLoCo(_outer, peer_dp=swarm_opt.PeerDP(noise_multiplier=1.0, clip=1.0)),
                        ValueError, "peer_dp=PeerDP"))),
}


class Peer:
    def __init__(self, info: StrategyInfo, seed: int, width: int = 8):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))
        self.inner = info.inner(list(self.model.parameters()))
        self.strategy = info.build(self.model)
        self.strategy.bind(list(self.model.parameters()), self.inner)
        self.g = torch.Generator().manual_seed(seed)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(8, 4, generator=self.g)
            self.inner.zero_grad()
            loss = (self.model(x) - x[:, :2] * (1 + self.g.initial_seed() % 3)).pow(2).mean()
            loss.backward()
            with torch.no_grad():
                self.strategy.observe_loss(float(loss))
                assert self.strategy.local_step(8)

    def snapshot(self) -> List[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


names = pytest.mark.parametrize("name", list(STRATEGIES))


def test_every_registered_strategy_has_an_entry_under_its_name():
    assert {name.split("+")[0] for name in STRATEGIES} == set(swarm_opt.strategies.STRATEGIES)
    for name, info in STRATEGIES.items():
        strategy = info.build(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 2)))
        assert isinstance(strategy, swarm_opt.strategies.STRATEGIES[name.split("+")[0]])
        assert strategy.name == name.split("+")[0]


@names
def test_capabilities_match_what_the_strategy_does(name):
    """What a class declares (``supports_groups``, ``dp_safe``) is what its instances do."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 2))
    strategy = STRATEGIES[name].build(model)
    if type(strategy).supports_groups:
        strategy.use_groups(swarm_opt.Groups(size=4))
    else:
        with pytest.raises(swarm_opt.ConfigError, match="groups"):
            strategy.use_groups(swarm_opt.Groups(size=4))
    if not vars(type(strategy)).get("dp_safe", False):  # declared by the class itself, or refused under DP-SGD
        assert "DP" in strategy.privacy_refusal() or "dp_safe" in strategy.privacy_refusal()


@names
def test_bad_arguments_raise_clear_errors(name):
    for make, error, match in STRATEGIES[name].bad_arguments:
        with pytest.raises(error, match=match):
            make()


@names
def test_rounds_keep_peers_finite_and_in_sync(name):
    peers = [Peer(STRATEGIES[name], seed) for seed in range(3)]
    for _ in range(4):
        for p in peers:
            p.train(3)
        average_in_process([p.strategy for p in peers])
    personal = {id(p) for p in peers[0].strategy.personal_parameters()}
    for param, a, b in zip(peers[0].model.parameters(), peers[0].snapshot(), peers[1].snapshot()):
        assert torch.isfinite(a).all()
        if id(param) in personal:  # KeepLocal: each peer's own, trained on its own data
            assert not torch.allclose(a, b)
        else:
            torch.testing.assert_close(a, b)  # every strategy leaves the group with one model after a round


@names
def test_with_clipping_every_inner_step_applies_a_gradient_within_the_norm_and_peers_stay_in_sync(name):
    """``clip_grad_norm`` hooks the inner optimizer's step, which every strategy goes through: whatever the strategy
    steps on (a round's mean, each local step's gradient) is within the norm, and a round still leaves one model."""
    max_norm = 1e-3  # below every gradient here: every step is clipped
    peers = [Peer(STRATEGIES[name], seed) for seed in range(3)]
    applied: List[float] = []
    for p in peers:
        clipping = GradNormClipping(p.inner, max_norm)
        p.inner.register_step_pre_hook(  # runs after the clipping (hooks run in the order they were registered)
            lambda opt, args, kwargs: applied.append(float(torch.nn.utils.get_total_norm(
                [q.grad for group in opt.param_groups for q in group["params"] if q.grad is not None]))))
    for _ in range(2):
        for p in peers:
            p.train(3)
        average_in_process([p.strategy for p in peers])
    assert applied and max(applied) <= max_norm * (1 + 1e-5) and clipping.last_norm > max_norm
    personal = {id(p) for p in peers[0].strategy.personal_parameters()}
    for param, a, b in zip(peers[0].model.parameters(), peers[0].snapshot(), peers[1].snapshot()):
        if id(param) not in personal:
            torch.testing.assert_close(a, b)


@names
def test_one_instance_serves_one_optimizer(name):
    peer = Peer(STRATEGIES[name], 0)
    with pytest.raises(swarm_opt.errors.ConfigError, match="pass a new instance"):
        peer.strategy.bind(list(peer.model.parameters()), peer.inner)


def _fail_a_round(strategy: swarm_opt.Strategy) -> List[torch.Tensor]:
    """What the optimizer does with a round whose all-reduce failed (``swarm_opt.round.RoundRunner``): the round
    begins, the averager takes its weight and its values, then the round is given back."""
    buffers = [buffer_like(t) for t in strategy.buffer_templates()]
    with torch.no_grad():
        begun = strategy.begin_round()
        assert begun.weight > 0
        begun.write(buffers)
        begun.give_back()
    return buffers


@names
def test_a_failed_round_is_a_no_op(name):
    peer, twin = Peer(STRATEGIES[name], 0), Peer(STRATEGIES[name], 0)  # the twin's rounds never fail
    peer.train(3)
    twin.train(3)
    before_params, before_inner = peer.snapshot(), copy.deepcopy(peer.inner.state_dict())
    before_state, before_weight = copy.deepcopy(peer.strategy.state_dict()), peer.strategy.averaging_weight()
    sent = _fail_a_round(peer.strategy)
    assert all(torch.isfinite(b).all() for b in sent)
    assert all(torch.equal(a, b) for a, b in zip(before_params, peer.snapshot()))
    _assert_same_state(before_inner, peer.inner.state_dict())
    _assert_same_state(before_state, peer.strategy.state_dict())
    assert peer.strategy.averaging_weight() == before_weight
    # what no state_dict shows (accumulated gradients, a round's samples) is unchanged too: the peer goes on exactly
    # as its twin, sends the same values and ends the next round with the same model
    peer.train(2)
    twin.train(2)
    assert peer.strategy.averaging_weight() == twin.strategy.averaging_weight()
    for a, b in zip(round_values(peer.strategy), round_values(twin.strategy)):
        assert torch.equal(a, b)
    average_in_process([peer.strategy])
    average_in_process([twin.strategy])
    for a, b in zip(peer.snapshot(), twin.snapshot()):
        assert torch.equal(a, b)
    _assert_same_state(peer.strategy.state_dict(), twin.strategy.state_dict())


@names
def test_a_foreign_saved_state_raises_incompatible_state_error(name):
    peer = Peer(STRATEGIES[name], 0)
    peer.train(2)
    own = peer.strategy.state_dict()
    other_model = Peer(STRATEGIES[name], 0, width=5)
    other_model.train(2)
    foreign = [{"unexpected": 1}, other_model.strategy.state_dict() or {"anchor": []}, [torch.zeros(1)]]
    foreign += [dict(own, **{key: value}) for key in own for value in ("garbage", [torch.zeros(1)], {"state": {}},
                                                                  [float("nan")])]
    # another peer's state with one part broken: a state that does not fit loads none of its other parts either
    others = [Peer(STRATEGIES[name], seed) for seed in (1, 2)]
    for _ in range(2):
        for p in others:
            p.train(3)
        average_in_process([p.strategy for p in others])
    theirs = others[0].strategy.state_dict()
    foreign += [dict(theirs, **{key: "garbage"}) for key in theirs]
    for state in foreign:
        with pytest.raises(swarm_opt.IncompatibleStateError):
            peer.strategy.load_state_dict(state)
        _assert_same_state(own, peer.strategy.state_dict())


@names
def test_state_dict_round_trips_and_a_late_joiner_gets_consistent_state(name):
    donor = Peer(STRATEGIES[name], 0)
    donor.train(3)
    average_in_process([donor.strategy])
    donor.train(2)
    state = donor.strategy.state_dict()
    joiner = Peer(STRATEGIES[name], 1)
    with torch.no_grad():
        for p, q in zip(joiner.model.parameters(), donor.model.parameters()):
            p.copy_(q)
    # deep copies: in one process torch's load_state_dict would share the donor's tensors (a download does not)
    joiner.inner.load_state_dict(copy.deepcopy(donor.inner.state_dict()))
    joiner.strategy.load_state_dict(copy.deepcopy(state))
    _assert_same_state(state, joiner.strategy.state_dict())
    joiner.strategy.reset()  # what the optimizer does after downloading the swarm's state
    joiner.train(2)
    average_in_process([joiner.strategy, donor.strategy])
    personal = {id(p) for p in joiner.strategy.personal_parameters()}  # KeepLocal's stay each peer's own
    for param, a, b in zip(joiner.model.parameters(), joiner.snapshot(), donor.snapshot()):
        assert torch.isfinite(a).all()
        if id(param) not in personal:
            torch.testing.assert_close(a, b)
    with pytest.raises((ValueError, KeyError, TypeError)):
        joiner.strategy.load_state_dict({"anchor": [torch.zeros(1)], "controls": [], "lr_sums": [], "outer": {}}
                                        if state else {"unexpected": 1})


def _assert_same_state(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_state(x, y)
    else:
        assert a == b
