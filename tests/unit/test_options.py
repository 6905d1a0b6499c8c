"""Options resolved once (``swarm_opt.options.resolve``): every pairing rule runs before anything is bound, the same
for ``Optimizer``, ``AuxiliaryPeer`` and the framework callbacks, and a refused option leaves the strategy usable."""

from __future__ import annotations

from unittest.mock import create_autospec

import pytest
import torch
from hivemind import DHT

import swarm_opt
from swarm_opt.errors import ConfigError, ConfigTypeError
from swarm_opt.options import resolve


def _model():
    return torch.nn.Linear(3, 2)


def _optimizer(strategy, **options):
    model = _model()
    return swarm_opt.Optimizer(dht=create_autospec(DHT, instance=True), run_id="options", target_batch_size=8,
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1), params=model.parameters(),
                               strategy=strategy, **options)


@pytest.mark.parametrize("options, message", [
    (dict(transport=swarm_opt.Gloo(), aggregation=swarm_opt.TrimmedMean()), "gloo's all-reduce"),
    (dict(transport=swarm_opt.Gloo(), compression=swarm_opt.Int8Blockwise()), "drop transport=Gloo"),
    (dict(compression=swarm_opt.PowerSGD(rank=2), groups=swarm_opt.Groups(size=4)), "without groups"),
    (dict(compression=swarm_opt.PowerSGD(rank=2), aggregation=swarm_opt.CenteredClip()), "pre-scaled"),
    (dict(timeouts=swarm_opt.Timeouts(), matchmaking_time=2.0), "given both"),
])
def test_a_conflict_is_refused_before_the_strategy_is_bound_so_the_same_strategy_can_be_used_again(options, message):
    strategy = swarm_opt.GradientAveraging()
    with pytest.raises(ConfigError, match=message):
        _optimizer(strategy, **options)
    # the strategy was neither bound nor told the refused groups: it serves the next try
    assert strategy.sends_changes and strategy.averages_gradients
    model = _model()
    strategy.bind(list(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1))


def test_resolve_returns_every_option_checked_with_the_codecs_defaults():
    averaging = resolve(compression=swarm_opt.PowerSGD(rank=2), matchmaking_time=2.0, averaging_timeout=20.0)
    assert isinstance(averaging.strategy, swarm_opt.GradientAveraging)
    assert averaging.aggregation == swarm_opt.Mean(max_norm_ratio=None)  # PowerSGD's plain mean
    assert averaging.timeouts == swarm_opt.Timeouts(matchmaking_time=2.0, averaging_timeout=20.0)
    grouped = resolve(strategy=swarm_opt.GradientAveraging(), groups=swarm_opt.Groups(size=4),
                      compression=swarm_opt.Float16())
    assert grouped.groups == swarm_opt.Groups(size=4) and not grouped.strategy.sends_changes  # told its groups
    with pytest.raises(ConfigTypeError, match="groups must be"):
        resolve(groups=4)
    with pytest.raises(ConfigError, match="auxiliary peers cannot join"):
        resolve(compression=swarm_opt.PowerSGD(rank=1), auxiliary=True)
    with pytest.raises(ConfigError, match="does not average in groups"):
        resolve(strategy=swarm_opt.FedNova(), groups=swarm_opt.Groups(size=4))


@pytest.mark.parametrize("module", ["swarm_opt.lightning", "swarm_opt.transformers"])
def test_the_callbacks_take_every_averaging_option_and_refuse_conflicts_at_construction(module):
    callback_type = pytest.importorskip(module).SwarmCallback
    callback = callback_type(run_id="r", target_batch_size=8, aggregation=swarm_opt.TrimmedMean(),
                             groups=swarm_opt.Groups(size=4), timeouts=swarm_opt.Timeouts(matchmaking_time=2.0))
    averaging = callback._options.averaging
    assert averaging.aggregation == swarm_opt.TrimmedMean() and averaging.groups == swarm_opt.Groups(size=4)
    assert callback._options.timeouts.matchmaking_time == 2.0
    assert callback_type(run_id="r", target_batch_size=8, transport=swarm_opt.Gloo())._options.averaging.transport
    with pytest.raises(ConfigError, match="gloo's all-reduce"):
        callback_type(run_id="r", target_batch_size=8, transport=swarm_opt.Gloo(), aggregation=swarm_opt.Mean())
    with pytest.raises(ConfigError, match="given both"):
        callback_type(run_id="r", target_batch_size=8, timeouts=swarm_opt.Timeouts(), averaging_timeout=30.0)
    with pytest.raises(ConfigTypeError, match="privacy must be"):
        callback_type(run_id="r", target_batch_size=8, privacy="dp")
