"""Peer-level DP (DP-FedAvg) with adaptive clipping: what a peer sends, how the noise is split, and the clip bound
moving to the target quantile of the updates' norms, through the same round code a real swarm runs."""

from __future__ import annotations

import math

import pytest
import torch

import swarm_opt
from swarm_opt.buffers import buffer_like
from swarm_opt.simulation import average_in_process, round_values


def _peer(peer_dp: swarm_opt.PeerDP, dim: int = 8):
    w = torch.nn.Parameter(torch.zeros(dim, dtype=torch.float64))
    strategy = swarm_opt.LocalUpdates(peer_dp=peer_dp)
    strategy.bind([w], torch.optim.SGD([w], lr=1.0))
    return w, strategy


def _move(w, strategy, update: torch.Tensor) -> None:
    """One local step that moves the parameters by ``update`` (SGD with lr 1 on the gradient -update)."""
    w.grad = -update.clone()
    assert strategy.local_step(1)


def test_an_update_is_clipped_to_norm_c_and_a_small_one_is_sent_as_it_is():
    w, strategy = _peer(swarm_opt.PeerDP(noise_multiplier=0.0, clip=1.0))
    x = w.detach().clone()
    _move(w, strategy, torch.full((8,), 10.0, dtype=torch.float64))
    sent = round_values(strategy)[0]
    assert (sent - x).norm().item() == pytest.approx(1.0)
    torch.testing.assert_close((sent - x) / (sent - x).norm(), (w - x).detach() / (w - x).detach().norm())
    w2, small = _peer(swarm_opt.PeerDP(noise_multiplier=0.0, clip=1.0))
    _move(w2, small, torch.full((8,), 0.1, dtype=torch.float64))
    torch.testing.assert_close(round_values(small)[0], w2.detach())


@pytest.mark.parametrize("split", [1, 4])
def test_the_noise_is_z_times_c_split_among_the_peers(split):
    w, strategy = _peer(swarm_opt.PeerDP(noise_multiplier=2.0, clip=0.5, split=split), dim=200_000)
    _move(w, strategy, torch.zeros(200_000, dtype=torch.float64))
    noise = round_values(strategy)[0]
    assert noise.std().item() == pytest.approx(2.0 * 0.5 / math.sqrt(split), rel=0.02)
    assert abs(noise.mean().item()) < 0.01


def test_every_peer_weighs_the_same_and_the_mean_of_noisy_clipped_updates_is_applied():
    peers = [_peer(swarm_opt.PeerDP(noise_multiplier=0.0, clip=1.0)) for _ in range(2)]
    for (w, s), steps in zip(peers, (1, 5)):
        for _ in range(steps):
            _move(w, s, torch.full((8,), 0.01, dtype=torch.float64))
    assert peers[0][1].averaging_weight() == peers[1][1].averaging_weight() == 1.0
    average_in_process([s for _, s in peers])
    torch.testing.assert_close(peers[0][0].detach(), torch.full((8,), 0.03, dtype=torch.float64))
    torch.testing.assert_close(peers[1][0].detach(), peers[0][0].detach())


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.8])
def test_adaptive_clipping_moves_c_to_the_target_quantile_of_the_update_norms(quantile):
    norms = [float(k) for k in range(1, 21)]  # 20 peers whose updates have norms 1..20 every round
    peers = [_peer(swarm_opt.PeerDP(noise_multiplier=0.0, clip=swarm_opt.AdaptiveClip(
        0.1, target_quantile=quantile, learning_rate=0.2))) for _ in norms]
    g = torch.Generator().manual_seed(0)
    clips = []
    for _ in range(120):
        for (w, s), norm in zip(peers, norms):
            direction = torch.randn(8, generator=g, dtype=torch.float64)
            _move(w, s, direction / direction.norm() * norm)
        average_in_process([s for _, s in peers])
        values = {s.peer_dp.clip for _, s in peers}
        assert len(values) == 1  # the same C on every peer
        clips.append(values.pop())
    assert clips[0] < clips[10] < clips[20]  # from 0.1, C grows geometrically while every update is clipped
    # then it stays where about `quantile` of the updates need no clipping
    for clip in clips[-30:]:
        unclipped = sum(n <= clip for n in norms) / len(norms)
        assert abs(unclipped - quantile) <= 0.1, (clip, quantile)


def test_a_drifted_clip_bound_is_the_groups_after_a_round_and_hostile_values_are_bounded():
    adaptive = dict(target_quantile=0.5, learning_rate=0.2)
    (w1, s1), (w2, s2) = (_peer(swarm_opt.PeerDP(noise_multiplier=0.0, clip=swarm_opt.AdaptiveClip(c, **adaptive)))
                          for c in (1.0, 3.0))
    for w, s in ((w1, s1), (w2, s2)):
        _move(w, s, torch.full((8,), 0.1, dtype=torch.float64))  # norm 0.28: unclipped on both
    average_in_process([s1, s2])
    assert s1.peer_dp.clip == s2.peer_dp.clip == pytest.approx(2.0 * math.exp(-0.2 * (1.0 - 0.5)))
    hostile = buffer_like(s1.peer_dp.templates()[0])
    hostile.copy_(torch.tensor([1.0, -50.0, 1.0, 1e300], dtype=torch.float64))  # C = 1e300, a bit of -50
    s1.peer_dp.finish_round([hostile])
    assert 0 < s1.peer_dp.clip <= 1e12


def test_state_round_trips_and_bad_arguments_name_the_fix():
    w, s = _peer(swarm_opt.PeerDP(noise_multiplier=1.0, clip=swarm_opt.AdaptiveClip(2.0)))
    state = s.state_dict()
    assert state["peer_dp"]["clip"] == 2.0
    s.load_state_dict(state)
    with pytest.raises(swarm_opt.IncompatibleStateError):
        s.load_state_dict({"peer_dp": {"clip": -1.0, "anchor": state["peer_dp"]["anchor"]}})
    with pytest.raises(ValueError, match="noise_multiplier"):
        swarm_opt.PeerDP(noise_multiplier=-1, clip=1.0)
    with pytest.raises(ValueError, match="split"):
        swarm_opt.PeerDP(noise_multiplier=1, clip=1.0, split=0)
    with pytest.raises(TypeError, match="PeerDP"):
        swarm_opt.LocalUpdates(peer_dp=1.0)
    dp = swarm_opt.PeerDP(noise_multiplier=1, clip=1.0)
    _peer(dp)
    with pytest.raises(ValueError, match="new PeerDP"):
        _peer(dp)


@pytest.mark.parametrize("z, releases, delta", [(1.0, 1, 1e-5), (1.0, 30, 1e-5), (2.5, 100, 1e-6), (0.7, 7, 1e-3),
                                                (8.0, 1000, 1e-5)])
def test_epsilon_of_gaussian_releases_is_opacus_rdp_accountants_at_sample_rate_one(z, releases, delta):
    from opacus.accountants import RDPAccountant

    from swarm_opt.strategies.peer_dp import gaussian_epsilon

    accountant = RDPAccountant()
    accountant.history = [(z, 1.0, releases)]
    assert gaussian_epsilon(z, releases, delta) == pytest.approx(accountant.get_epsilon(delta), rel=1e-9)


def test_every_release_is_counted_and_epsilon_is_against_the_groupmates_multiplier():
    from opacus.accountants import RDPAccountant

    w, s = _peer(swarm_opt.PeerDP(noise_multiplier=2.0, clip=1.0, split=4, delta=1e-5))
    assert s.epsilon() == 0.0
    for releases in (1, 2, 3):
        _move(w, s, torch.full((8,), 0.1, dtype=torch.float64))
        round_values(s)  # a round written (and given back, as a failed round: still a release)
        assert s.peer_dp.releases == releases
        accountant = RDPAccountant()
        accountant.history = [(2.0 / math.sqrt(4), 1.0, releases)]  # each update carries z / sqrt(split)
        assert s.epsilon() == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    average_in_process([s])  # a committed round alone still wrote its tensors
    assert s.peer_dp.releases == 4
    assert swarm_opt.LocalUpdates(peer_dp=swarm_opt.PeerDP(noise_multiplier=1.0, clip=1.0)).epsilon() is None
    assert swarm_opt.LocalUpdates().epsilon() is None


def test_the_clipping_bit_is_composed_and_a_bit_sent_in_clear_spends_unbounded_privacy():
    noisy = swarm_opt.PeerDP(noise_multiplier=2.0, clip=swarm_opt.AdaptiveClip(1.0, bit_noise=4.0), delta=1e-5)
    assert noisy.effective_noise_multiplier() == pytest.approx((2.0 ** -2 + 4.0 ** -2) ** -0.5)
    w, s = _peer(swarm_opt.PeerDP(noise_multiplier=2.0, clip=swarm_opt.AdaptiveClip(1.0), delta=1e-5))
    _move(w, s, torch.full((8,), 0.1, dtype=torch.float64))
    round_values(s)
    assert s.epsilon() == math.inf
    w, s = _peer(swarm_opt.PeerDP(noise_multiplier=0.0, clip=1.0, delta=1e-5))
    round_values(s)
    assert s.epsilon() == math.inf
    with pytest.raises(ValueError, match="delta"):
        swarm_opt.PeerDP(noise_multiplier=1, clip=1.0, delta=1.5)
