"""``swarm_opt.OpacusPrivacy``: the strategies where Opacus's DP-SGD stays private in a swarm are accepted, the others
are refused with an error that names the fix; ε is Opacus's accountant's."""

from __future__ import annotations

import warnings
from unittest.mock import create_autospec

import pytest
import torch

opacus = pytest.importorskip("opacus")

import swarm_opt  # noqa: E402
from swarm_opt.errors import ConfigError, ConfigTypeError  # noqa: E402


def _private(noise: float = 1.0):
    """An Opacus-private model and optimizer, as a user makes them."""
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")  # Opacus's advice, fine for tests
        engine = opacus.PrivacyEngine(accountant="rdp")
        model, dp_sgd, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=torch.utils.data.DataLoader(data, batch_size=16), noise_multiplier=noise, max_grad_norm=1.0)
    return engine, model, dp_sgd, loader


def _optimizer(strategy, inner, privacy):
    from hivemind import DHT

    return swarm_opt.Optimizer(dht=create_autospec(DHT, instance=True), run_id="dp_check", target_batch_size=64,
                               optimizer=inner, strategy=strategy, privacy=privacy)


@pytest.mark.parametrize("strategy, message", [
    (swarm_opt.GradientAveraging(), "raw accumulated gradients"),
    (swarm_opt.GradientAveraging(overlap=swarm_opt.Overlap()), "raw accumulated gradients"),
    (swarm_opt.FedProx(mu=0.1), "silently dropped"),
    (swarm_opt.FedProx(mu=0.0, adaptive=swarm_opt.AdaptiveMu()), "silently dropped"),  # its μ grows
])
def test_strategies_that_would_send_un_noised_data_are_refused(strategy, message):
    engine, _, dp_sgd, _ = _private()
    with pytest.raises(ConfigError, match=message):
        _optimizer(strategy, dp_sgd, swarm_opt.OpacusPrivacy(engine, delta=1e-5))


def test_an_unknown_strategy_is_refused():
    class Custom(swarm_opt.LocalUpdates):
        name = "custom"

    engine, _, dp_sgd, _ = _private()
    with pytest.raises(ConfigError, match="not known to keep DP-SGD private"):
        swarm_opt.OpacusPrivacy(engine, delta=1e-5).check(Custom(), dp_sgd)


def test_a_subclass_is_accepted_when_it_declares_dp_safe_itself():
    class Declared(swarm_opt.Scaffold):
        dp_safe = True  # its rounds send only what the DP-SGD steps computed

    class Undeclared(swarm_opt.Scaffold):
        pass

    engine, _, dp_sgd, _ = _private()
    swarm_opt.OpacusPrivacy(engine, delta=1e-5).check(Declared(), dp_sgd)
    with pytest.raises(ConfigError, match="declare dp_safe = True on Undeclared"):
        swarm_opt.OpacusPrivacy(engine, delta=1e-5).check(Undeclared(), dp_sgd)


@pytest.mark.parametrize("strategy", [swarm_opt.LocalUpdates(), swarm_opt.Scaffold(), swarm_opt.FedProx(mu=0.0),
                                      swarm_opt.DiLoCo(outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7))])
def test_strategies_whose_local_steps_are_dp_sgd_steps_are_accepted(strategy):
    engine, model, dp_sgd, _ = _private()
    swarm_opt.OpacusPrivacy(engine, delta=1e-5).check(strategy, dp_sgd)
    strategy.bind(list(model.parameters()), dp_sgd)  # and the strategy takes the private optimizer


def test_a_non_private_optimizer_and_bad_arguments_are_refused():
    engine, model, _, _ = _private()
    with pytest.raises(ConfigError, match="make_private"):
        _optimizer(swarm_opt.LocalUpdates(), torch.optim.SGD(model.parameters(), lr=0.1),
                   swarm_opt.OpacusPrivacy(engine, delta=1e-5))
    with pytest.raises(ConfigTypeError, match="OpacusPrivacy"):
        _optimizer(swarm_opt.LocalUpdates(), torch.optim.SGD(model.parameters(), lr=0.1), privacy=engine)
    for delta in (0, 1, -1e-5, "1e-5"):
        with pytest.raises(ConfigError, match="delta"):
            swarm_opt.OpacusPrivacy(engine, delta=delta)
    with pytest.raises(ConfigTypeError, match="PrivacyEngine"):
        swarm_opt.OpacusPrivacy(object(), delta=1e-5)


def test_epsilon_is_the_accountants_and_appears_in_the_log_suffix():
    engine, model, dp_sgd, loader = _private(noise=1.3)
    privacy = swarm_opt.OpacusPrivacy(engine, delta=1e-5)
    assert privacy.epsilon() == 0.0
    steps = 0
    for x, y in loader:
        dp_sgd.zero_grad()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            torch.nn.functional.cross_entropy(model(x), y).backward()
        dp_sgd.step()
        steps += 1
    accountant = opacus.accountants.RDPAccountant()
    accountant.history = [(1.3, 1 / len(loader), steps)]
    assert privacy.epsilon() == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert privacy.log_suffix() == f", ε {privacy.epsilon():.6g} at δ 1e-05"
    before = privacy.epsilon()  # computed once per history: each further step is counted
    engine.accountant.step(noise_multiplier=1.3, sample_rate=1 / len(loader))
    accountant.history = [(1.3, 1 / len(loader), steps + 1)]
    assert privacy.epsilon() == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert privacy.epsilon() > before


@pytest.mark.parametrize("mechanism", ["rdp", "prv"])
def test_epsilon_equals_the_accountants_bit_for_bit_over_several_noise_levels(mechanism):
    """The RDP accountant's ε from one step's RDP per (noise, rate), scaled: exactly what the accountant computes
    (it recomputes every step's RDP in each call); other accountants are asked themselves."""
    engine, _, _, _ = _private()
    engine.accountant = opacus.accountants.create_accountant(mechanism)
    privacy = swarm_opt.OpacusPrivacy(engine, delta=1e-5)
    history = []
    for noise, rate, steps in [(1.3, 0.25, 5), (0.9, 0.25, 3), (1.3, 0.25, 7)]:
        history.append((noise, rate, steps))
        engine.accountant.history = list(history)
        reference = opacus.accountants.create_accountant(mechanism)
        reference.history = list(history)
        assert privacy.epsilon() == reference.get_epsilon(1e-5)


def test_the_accountant_survives_a_checkpoint(tmp_path):
    """A resumed peer must not under-report its privacy: the accountant's history goes into its checkpoint."""
    engine, model, dp_sgd, loader = _private()
    privacy = swarm_opt.OpacusPrivacy(engine, delta=1e-5)
    engine.accountant.history = [(1.0, 0.25, 7)]  # as after 7 DP steps
    path = tmp_path / "ckpt.pt"
    torch.save({"privacy": privacy.state_dict()}, path)
    fresh, _, _, _ = _private()
    resumed = swarm_opt.OpacusPrivacy(fresh, delta=1e-5)
    resumed.load_state_dict(torch.load(path, weights_only=True)["privacy"])  # as Checkpointer's extra loads it
    assert resumed.epsilon() == privacy.epsilon() > 0
    with pytest.raises(swarm_opt.IncompatibleStateError, match="accountant"):
        resumed.load_state_dict({"steps": 7})


def _scaffold_peers(private: bool, noise: float = 0.0, clip: float = 1e6):
    """Three SCAFFOLD peers on heterogeneous data (each its own labels' skew), the same initial model; with
    ``private`` each local step is Opacus's DP-SGD step (fixed batches: no Poisson sampling)."""
    from swarm_opt.simulation import average_in_process

    peers = []
    for rank in range(3):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(32, 4, generator=g) + rank
        y = (x[:, rank % 4] > rank).long()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        if private:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Secure RNG turned off")
                engine = opacus.PrivacyEngine(accountant="rdp")
                model, inner, _ = engine.make_private(
                    module=model, optimizer=inner, noise_multiplier=noise, max_grad_norm=clip, poisson_sampling=False,
                    data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
        strategy = swarm_opt.Scaffold()
        strategy.bind([p for p in model.parameters()], inner)
        peers.append((model, inner, strategy, x, y))
    with warnings.catch_warnings():  # Opacus's hooks on a first layer whose inputs need no gradient: expected
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for _ in range(3):  # rounds
            for model, inner, strategy, x, y in peers:
                for step in range(4):
                    inner.zero_grad()
                    batch = slice(8 * step, 8 * step + 8)
                    torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                    strategy.local_step(8)
            average_in_process([s for _, _, s, _, _ in peers])
    return [[p.detach().clone() for p in m.parameters()] for m, *_ in peers], [s.controls for _, _, s, _, _ in peers]


def test_dp_scaffold_without_noise_or_clipping_is_scaffold_and_with_dp_still_corrects():
    """DP-SCAFFOLD is SCAFFOLD whose local steps are DP-SGD steps: at noise 0 and a clipping bound no gradient
    reaches, every parameter and control equals plain SCAFFOLD's; with noise and clipping the controls are still
    updated (the correction is applied, not dropped)."""
    plain_params, plain_controls = _scaffold_peers(private=False)
    dp_params, dp_controls = _scaffold_peers(private=True)
    for got, expected in zip(dp_params + dp_controls, plain_params + plain_controls):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert max(float(d.abs().max()) for controls in plain_controls for d in controls) > 1e-3  # not FedAvg in disguise
    _, noisy_controls = _scaffold_peers(private=True, noise=1.0, clip=1.0)
    assert max(float(d.abs().max()) for controls in noisy_controls for d in controls) > 1e-3


def test_clip_grad_norm_is_refused_with_opacus_which_clips_each_sample_itself():
    engine, _, dp_sgd, _ = _private()
    from hivemind import DHT

    with pytest.raises(ConfigError, match="max_grad_norm=.*drop clip_grad_norm"):
        swarm_opt.Optimizer(dht=create_autospec(DHT, instance=True), run_id="dp_check", target_batch_size=64,
                            optimizer=dp_sgd, strategy=swarm_opt.LocalUpdates(),
                            privacy=swarm_opt.OpacusPrivacy(engine, delta=1e-5), clip_grad_norm=1.0)
