"""``clip_grad_norm``: what is clipped (the gradient the inner optimizer applies, never a micro-batch), with each
kind of strategy, and the inputs refused. No network: strategies bound by hand, rounds averaged in process."""

from __future__ import annotations

import math
from unittest.mock import create_autospec

import pytest
import torch
from hivemind import DHT

import swarm_opt
from swarm_opt.buffers import AveragingResult
from swarm_opt.clipping import GradNormClipping
from swarm_opt.errors import ConfigError, ConfigTypeError
from swarm_opt.simulation import average_in_process, round_values


def _bound(strategy, max_norm: float = 1.0, lr: float = 1.0):
    w = torch.nn.Parameter(torch.zeros(2))
    inner = torch.optim.SGD([w], lr=lr)
    strategy.bind([w], inner)
    return w, inner, GradNormClipping(inner, max_norm)


def _local_step(strategy, w, grad, batch_size: int) -> None:
    w.grad = torch.tensor(grad)
    assert strategy.local_step(batch_size)


def test_gradient_averaging_clips_the_accumulated_mean_not_each_micro_batch():
    """Micro-batches [3, 0] and [0, 4] (one sample each): their mean [1.5, 2] (norm 2.5) is clipped to norm 1,
    [0.6, 0.8]; clipping each micro-batch first would apply [0.5, 0.5]."""
    strategy = swarm_opt.GradientAveraging()
    w, _, clipping = _bound(strategy)
    _local_step(strategy, w, [3.0, 0.0], 1)
    _local_step(strategy, w, [0.0, 4.0], 1)
    torch.testing.assert_close(round_values(strategy)[0], torch.tensor([1.5, 2.0]))  # the round sends it unclipped
    strategy.begin_round().apply(AveragingResult(peers=(), gathered={}))  # a round alone
    torch.testing.assert_close(w.detach(), torch.tensor([-0.6, -0.8]))
    assert clipping.last_norm == pytest.approx(2.5)


def test_every_member_clips_the_same_group_mean_and_stays_identical():
    """Two peers of 1 and 3 samples: each clips the group's sample-weighted mean, so both apply the same step,
    that of one process clipping the union of their batches."""
    peers = [swarm_opt.GradientAveraging() for _ in range(2)]
    bound = [_bound(s, max_norm=0.5) for s in peers]
    _local_step(peers[0], bound[0][0], [4.0, 0.0], 1)
    _local_step(peers[1], bound[1][0], [0.0, 4.0], 3)
    average_in_process(peers)
    mean = torch.tensor([1.0, 3.0])  # (1·[4, 0] + 3·[0, 4]) / 4
    expected = -mean * 0.5 / mean.norm()
    for w, _, clipping in bound:
        torch.testing.assert_close(w.detach(), expected)
        assert clipping.last_norm == pytest.approx(float(mean.norm()))


@pytest.mark.parametrize("make", [swarm_opt.LocalUpdates, lambda: swarm_opt.FedProx(mu=0.0), swarm_opt.Scaffold,
                                  lambda: swarm_opt.DiLoCo(outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7))],
                         ids=["local", "fedprox", "scaffold", "diloco"])
def test_local_updates_clip_each_local_step_as_one_process_would(make):
    strategy = make()
    w, _, clipping = _bound(strategy)
    _local_step(strategy, w, [3.0, 4.0], 8)  # norm 5: clipped to 1
    torch.testing.assert_close(w.detach(), torch.tensor([-0.6, -0.8]))
    _local_step(strategy, w, [0.3, 0.4], 8)  # norm 0.5: applied as it is
    torch.testing.assert_close(w.detach(), torch.tensor([-0.9, -1.2]))
    assert clipping.last_norm == pytest.approx(0.5)


def test_fedprox_clips_the_gradient_with_its_proximal_pull():
    """FedProx's step applies ∇f + μ(y − x): one process minimising f + μ/2‖y − x‖² clips that whole gradient."""
    strategy = swarm_opt.FedProx(mu=1.0)
    w, _, clipping = _bound(strategy, lr=0.5)
    _local_step(strategy, w, [2.0, 0.0], 1)  # y = x: no pull yet; [2, 0] clipped to [1, 0]
    torch.testing.assert_close(w.detach(), torch.tensor([-0.5, 0.0]))
    _local_step(strategy, w, [0.0, 0.0], 1)  # the pull alone, μ(y − x) = [-0.5, 0]: under the norm
    torch.testing.assert_close(w.detach(), torch.tensor([-0.25, 0.0]))
    assert clipping.last_norm == pytest.approx(0.5)


def test_removing_the_clipping_leaves_the_optimizer_as_it_was():
    strategy = swarm_opt.LocalUpdates()
    w, inner, clipping = _bound(strategy)
    clipping.remove()
    assert not inner._optimizer_step_pre_hooks
    _local_step(strategy, w, [3.0, 4.0], 1)
    torch.testing.assert_close(w.detach(), torch.tensor([-3.0, -4.0]))


def test_all_param_groups_are_clipped_together():
    """One norm over every parameter of every group (weight decay on one, none on the other), as
    ``torch.nn.utils.clip_grad_norm_(model.parameters())``."""
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    inner = torch.optim.SGD([{"params": [a]}, {"params": [b], "weight_decay": 0.0}], lr=1.0)
    strategy = swarm_opt.LocalUpdates()
    strategy.bind([a, b], inner)
    GradNormClipping(inner, 1.0)
    a.grad, b.grad = torch.tensor([3.0]), torch.tensor([4.0])
    assert strategy.local_step(1)
    torch.testing.assert_close(torch.cat([a.detach(), b.detach()]), torch.tensor([-0.6, -0.8]))


@pytest.mark.parametrize("value, error, match", [
    (-1.0, ConfigError, "positive finite"),
    (0, ConfigError, "clip_grad_norm=None"),
    (math.nan, ConfigError, "positive finite"),
    (math.inf, ConfigError, "positive finite"),
    ("1.0", ConfigTypeError, "a number such as 1.0"),
    (True, ConfigTypeError, "a number such as 1.0"),
    (torch.tensor(1.0), ConfigTypeError, "a number such as 1.0"),
])
def test_bad_clip_grad_norm_is_refused_before_anything_starts(value, error, match):
    model = torch.nn.Linear(2, 1)
    dht = create_autospec(DHT, instance=True)  # never reached: refused first
    with pytest.raises(error, match=match):
        swarm_opt.Optimizer(dht=dht, run_id="clip", target_batch_size=8, params=model.parameters(),
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), clip_grad_norm=value)
    assert not dht.method_calls
