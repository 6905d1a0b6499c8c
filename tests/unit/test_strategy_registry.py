"""One registry of strategies, ``swarm_opt.strategies.STRATEGIES``, keyed by ``Strategy.name``, serves the CLI."""

from __future__ import annotations

import pytest
import torch

import swarm_opt
from swarm_opt.cli.commands import OPTIONS, build_parser, resolve_options
from swarm_opt.cli.train import make_strategy


def test_registry_keys_are_the_strategies_names():
    assert list(swarm_opt.strategies.STRATEGIES) == ["grad", "local", "fedprox", "scaffold", "diloco", "fednova"]
    for name, strategy in swarm_opt.strategies.STRATEGIES.items():
        assert issubclass(strategy, swarm_opt.Strategy) and strategy.name == name


def test_the_strategy_option_lists_and_explains_every_registered_strategy():
    option = next(o for o in OPTIONS["train"] if o.flag == "--strategy")
    assert tuple(option.current_choices()) == tuple(swarm_opt.strategies.STRATEGIES)
    for name in swarm_opt.strategies.STRATEGIES:  # fednova was missing from a hand-written help
        assert f"{name}: " in option.help()


def _train_args(*flags: str):
    given = build_parser().parse_args(["train", "--run-id", "r", *flags])
    return resolve_options("train", given, environ={})


@pytest.mark.parametrize("name", list(swarm_opt.strategies.STRATEGIES))
def test_the_command_line_builds_every_registered_strategy_by_its_name(name):
    strategy = make_strategy(_train_args("--strategy", name))
    assert type(strategy) is swarm_opt.strategies.STRATEGIES[name]


def test_the_command_line_passes_each_strategy_its_options():
    assert make_strategy(_train_args("--strategy", "fedprox", "--fedprox-mu", "0.5")).mu == 0.5
    diloco = make_strategy(_train_args("--strategy", "diloco", "--outer-lr", "0.3", "--outer-momentum", "0"))
    w = torch.nn.Parameter(torch.zeros(2))
    diloco.bind([w], torch.optim.SGD([w], lr=0.1))
    assert diloco.outer.defaults["lr"] == 0.3 and diloco.outer.defaults["nesterov"] is False


def test_the_command_line_selects_worker_momentum_for_gradient_averaging():
    from swarm_opt.cli.train import make_inner_optimizer

    args = _train_args("--worker-momentum", "0.8", "--aggregation", "trimmed-mean:0.2")
    assert make_strategy(args).momentum == swarm_opt.WorkerMomentum(0.8)
    w = torch.nn.Parameter(torch.zeros(2))
    assert make_inner_optimizer(args)([w]).defaults["momentum"] == 0.0  # the workers' momentum replaces the inner one
    assert make_inner_optimizer(_train_args())([w]).defaults["momentum"] == 0.9
    assert make_strategy(_train_args()).momentum is None
    with pytest.raises(swarm_opt.ConfigError, match="applies to --strategy grad, not local"):
        make_strategy(_train_args("--strategy", "local", "--worker-momentum", "0.9"))
    with pytest.raises(swarm_opt.ConfigError, match="applies to --strategy grad or diloco, not fedprox"):
        make_strategy(_train_args("--strategy", "fedprox", "--overlap"))
    with pytest.raises(swarm_opt.ConfigError, match="drop --momentum"):
        make_inner_optimizer(_train_args("--worker-momentum", "0.9", "--momentum", "0.5"))([w])
    with pytest.raises(Exception, match=r"worker-momentum.*must be in \[0, 1\)"):  # one line naming the bound
        _train_args("--worker-momentum", "1.5")


def test_the_command_line_overlaps_rounds_of_gradient_averaging_and_diloco():
    assert make_strategy(_train_args("--overlap")).overlap == swarm_opt.Overlap()
    assert make_strategy(_train_args("--strategy", "diloco", "--overlap")).overlap == swarm_opt.Overlap()
    assert make_strategy(_train_args("--strategy", "diloco")).overlap is None
