"""A new strategy is a file, one registry row and one conformance entry: a toy strategy written here, registered at
test time (``swarm_opt.strategies.register``), joins ``STRATEGIES``, the package's names and the command line's
``--strategy`` by its row alone, and passes every check of ``test_strategies.py`` by its one entry there."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

import swarm_opt
from swarm_opt import strategies
from swarm_opt.buffers import AveragingResult
from swarm_opt.cli.commands import build_parser, resolve_options
from swarm_opt.cli.train import make_strategy
from swarm_opt.strategies.base import Strategy, grads_are_finite
from tests.conformance import test_strategies as conformance


class Toy(Strategy):
    """Local SGD in a few lines: each step is an inner step; a round averages the parameters weighted by the samples
    each peer trained on since its last round."""

    name = "toy"
    supports_groups = True  # a round's mean is its group's; the next rounds mix the groups
    dp_safe = True  # a round sends parameters that DP-SGD steps computed

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self.samples = 0

    def local_step(self, batch_size: int) -> bool:
        if not grads_are_finite([p.grad for p in self.params if p.grad is not None]):
            return False
        self.inner.step()
        self.samples += batch_size
        return True

    def buffer_templates(self) -> list:
        return [p.detach() for p in self.params]

    def write_round(self, buffers: Sequence[torch.Tensor]) -> None:
        for buffer, p in zip(buffers, self.params):
            buffer.copy_(p)

    def averaging_weight(self) -> float:
        return float(max(self.samples, 1))

    def apply_round(self, result: AveragingResult) -> None:
        if result.averaged is not None:
            for p, mean in zip(self.params, result.averaged):
                p.copy_(mean)
        self.samples = 0

    def reset(self) -> None:
        self.samples = 0


@pytest.fixture
def toy(monkeypatch):
    """The toy's registry row and its conformance entry, for one test."""
    strategies.register(strategies.StrategyRow("toy", __name__, "Toy", "a toy local SGD (tests)"))
    monkeypatch.setitem(conformance.STRATEGIES, "toy", conformance.StrategyInfo(Toy))
    try:
        yield Toy
    finally:
        strategies.unregister("toy")


def test_a_registered_strategy_joins_the_registry_the_package_and_the_command_line(toy):
    assert strategies.STRATEGIES["toy"] is toy and strategies.STRATEGY_NAMES["toy"] == "Toy"
    assert strategies.Toy is toy and swarm_opt.Toy is toy and "Toy" in strategies.__all__
    given = build_parser().parse_args(["train", "--run-id", "r", "--strategy", "toy"])
    assert type(make_strategy(resolve_options("train", given, environ={}))) is toy
    assert "toy: a toy local SGD (tests)" in strategies.strategy_help()


def test_an_unregistered_strategy_is_gone_from_the_registry_and_the_command_line():
    assert "toy" not in strategies.STRATEGIES and "toy" not in strategies.strategy_help()
    with pytest.raises(Exception, match="invalid choice: 'toy'"):
        build_parser().parse_args(["train", "--run-id", "r", "--strategy", "toy"])


def test_a_registered_strategy_passes_every_conformance_check(toy):
    conformance.test_every_registered_strategy_has_an_entry_under_its_name()
    conformance.test_capabilities_match_what_the_strategy_does("toy")
    conformance.test_bad_arguments_raise_clear_errors("toy")
    conformance.test_rounds_keep_peers_finite_and_in_sync("toy")
    conformance.test_with_clipping_every_inner_step_applies_a_gradient_within_the_norm_and_peers_stay_in_sync("toy")
    conformance.test_one_instance_serves_one_optimizer("toy")
    conformance.test_a_failed_round_is_a_no_op("toy")
    conformance.test_a_foreign_saved_state_raises_incompatible_state_error("toy")
    conformance.test_state_dict_round_trips_and_a_late_joiner_gets_consistent_state("toy")
    checks = [name for name in vars(conformance) if name.startswith("test_")]
    assert len(checks) == 9, f"a new conformance check? run it on the toy above too: {checks}"
