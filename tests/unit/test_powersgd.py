"""PowerSGD's maths and bookkeeping without a network: the round a group computes (``PeerRound`` steps, the code the
averager runs, with the all-reduces replaced by sums), the orthogonalization, the commit protocol of the residuals,
and the configuration checks."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import pytest
import torch

import swarm_opt
from swarm_opt._hivemind.powersgd_engine import PowerSGDEngine, _Tag, _winning_lineage
from swarm_opt.compression.powersgd import (
    ORTHOGONALIZATION_FLOOR,
    ErrorFeedback,
    PeerRound,
    PowerSGD,
    initial_factors,
    is_compressed,
    orthogonalize,
    simulate_round,
    unit_columns,
)
from swarm_opt.errors import ConfigError, ConfigTypeError

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Group:
    """N peers compressing one n×m matrix each round, with the averager's bookkeeping: each peer's ErrorFeedback
    begins a round with what its own host committed last, the group runs the round (simulate_round), the hosts
    commit it or discard it."""

    def __init__(self, n: int, m: int, rank: int, peers: int, dtype: torch.dtype = F64) -> None:
        self.shape, self.rank = (n, m), rank
        self.q = initial_factors([self.shape], rank, seed=0, dtypes=[dtype])
        self.feedback = [ErrorFeedback([self.shape], [dtype]) for _ in range(peers)]
        self.committed = [(-1, 0)] * peers  # per peer: (attempt, round) its host committed last
        self.round = 0  # the swarm's last committed round
        self.attempt = 0
        self.dropped = torch.zeros(self.shape, dtype=dtype)  # residuals reset by peers that skipped rounds
        self.total_weight: Optional[float] = None  # what the averagers remember of the last round

    def run(self, grads: Sequence[torch.Tensor], weights: Sequence[float], commit: bool = True,
            members: Sequence[int] = ()) -> List[torch.Tensor]:
        """One round among ``members`` (default: all); returns each member's update."""
        members = list(members) or list(range(len(self.feedback)))
        self.attempt += 1
        rounds = []
        for i in members:
            if self.committed[i][1] != self.round:  # this peer missed a committed round: it starts from R = 0
                self.dropped += self.residual(i)
            residuals, shares = self.feedback[i].begin(self.round + 1, *self.committed[i])
            rounds.append(PeerRound([grads[i]], residuals, shares, self.q, weight=weights[i],
                                    weight_estimate=self.total_weight))
        updates, self.q, self.total_weight = simulate_round(rounds)
        for i in members:
            self.feedback[i].stage(self.attempt)
        if commit:
            self.round += 1
            for i in members:
                self.committed[i] = (self.attempt, self.round)
        return [u[0] for u in updates]

    def residual(self, i: int) -> torch.Tensor:
        """Peer i's residual as of its last committed round (its staged candidate if that was committed)."""
        fb = self.feedback[i]
        adopted = fb._staged is not None and fb._staged == self.committed[i][0]
        return fb._sets[1 - fb._current if adopted else fb._current][0]

    def residuals(self) -> List[torch.Tensor]:
        return [self.residual(i) for i in range(len(self.feedback))]


# --- configuration ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error", [(dict(rank=0), ConfigError), (dict(rank=-1), ConfigError),
                                           (dict(rank=2.0), ConfigTypeError), (dict(rank=True), ConfigTypeError),
                                           (dict(seed=-1), ConfigError), (dict(seed="1"), ConfigTypeError),
                                           (dict(factors="fp16"), ConfigTypeError),
                                           (dict(factors=PowerSGD()), ConfigTypeError)])
def test_bad_configurations_are_refused(kwargs, error):
    with pytest.raises(error, match="PowerSGD"):
        PowerSGD(**kwargs)


def test_config_is_frozen_and_exported():
    config = swarm_opt.PowerSGD(rank=2, seed=7)
    assert repr(config) == "swarm_opt.PowerSGD(rank=2, seed=7)"
    with pytest.raises(AttributeError):
        config.rank = 3  # type: ignore[misc]
    assert PowerSGD() == PowerSGD(rank=4, seed=0, factors=swarm_opt.NoCompression())
    half = swarm_opt.PowerSGD(rank=2, factors=swarm_opt.Float16())
    assert repr(half) == "swarm_opt.PowerSGD(rank=2, seed=0, factors=swarm_opt.Float16())"
    assert half != PowerSGD(rank=2) and hash(half) == hash(swarm_opt.PowerSGD(rank=2, factors=swarm_opt.Float16()))


def _optimizer_kwargs():
    from unittest.mock import create_autospec

    from hivemind import DHT

    model = torch.nn.Linear(2, 1)
    return dict(dht=create_autospec(DHT, instance=True), run_id="powersgd_check", target_batch_size=8,
                optimizer=lambda p: torch.optim.SGD(p, lr=0.1), params=model.parameters())


@pytest.mark.parametrize("strategy", [swarm_opt.LocalUpdates, swarm_opt.Scaffold, lambda: swarm_opt.FedProx(mu=0.1),
                                      lambda: swarm_opt.DiLoCo(outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7))])
def test_strategies_that_average_parameters_refuse_powersgd(strategy):
    with pytest.raises(ConfigError, match=r"works only with strategy=swarm_opt\.GradientAveraging\(\).*Float16"):
        swarm_opt.Optimizer(**_optimizer_kwargs(), strategy=strategy(), compression=PowerSGD(rank=2))


def test_foreign_codecs_error_names_powersgd_too():
    with pytest.raises(ConfigTypeError, match=r"swarm_opt\.PowerSGD\(rank=4\)"):
        swarm_opt.Optimizer(**_optimizer_kwargs(), compression="powersgd")


# --- which tensors, how many bytes -----------------------------------------------------------------------------------
def test_only_matrices_whose_factors_are_smaller_are_compressed():
    assert not is_compressed((1000,), 1)  # biases
    assert is_compressed((784, 256), 4)
    assert is_compressed((64, 3, 3, 3), 4)  # a conv weight, viewed as 64 × 27
    assert not is_compressed((8, 5), 3 + 1)  # 4·13 = 52 ≥ 40
    assert is_compressed((8, 5), 3)  # 39 < 40
    for n, m in [(2, 2), (5, 3), (7, 64), (300, 20)]:
        for rank in range(min(n, m), min(n, m) + 3):  # rank ≥ min(n, m): the factors are never smaller
            assert not is_compressed((n, m), rank)


def test_min_compression_sends_narrow_matrices_whole():
    assert is_compressed((2800, 10), 4) and not is_compressed((2800, 10), 4, min_compression=4)  # 2.49x
    assert is_compressed((2800, 2800), 4, min_compression=4)  # 350x
    assert is_compressed((10, 10), 1, min_compression=5) and not is_compressed((10, 10), 1, min_compression=5.1)
    codec = swarm_opt.PowerSGD(rank=4, min_compression=4)
    shapes = [(2800, 784), (2800,), (10, 2800), (10,)]
    assert codec.values_per_round(shapes) == 4 * (2800 + 784) + 2800 + 28000 + 10 + 1  # the 10x2800 layer whole
    assert swarm_opt.PowerSGD(rank=4).values_per_round(shapes) == 4 * (2800 + 784 + 10 + 2800) + 2800 + 10 + 1
    assert "min_compression=4" in repr(codec) and "min_compression" not in repr(swarm_opt.PowerSGD())


@pytest.mark.parametrize("value, error", [(0.5, ConfigError), (float("inf"), ConfigError), (float("nan"), ConfigError),
                                          (True, ConfigTypeError), ("4", ConfigTypeError)])
def test_min_compression_below_one_or_not_a_number_is_refused(value, error):
    with pytest.raises(error, match="min_compression"):
        swarm_opt.PowerSGD(min_compression=value)


def test_members_with_another_compressed_set_fail_the_round_naming_the_difference():
    """Peers that disagree on which tensors travel as factors would run phases of different shapes: the tags they
    gather say so first, and the round fails with a message naming both configurations."""
    from types import SimpleNamespace

    from hivemind.averaging.allreduce import AllreduceException

    ours = SimpleNamespace(config=PowerSGD(rank=4, min_compression=4))
    group = SimpleNamespace(peer_ids=["a", "b"])

    def tag(codec: PowerSGD) -> dict:  # what a member of that configuration gathers
        return {"powersgd": list(_Tag(0, codec.rank, codec.seed, 0, 1, float(codec.min_compression)))}

    same = [tag(ours.config), tag(PowerSGD(rank=4, min_compression=4.0))]
    assert [t.min_compression for t in PowerSGDEngine._check_tags(ours, group, same)] == [4.0, 4.0]
    with pytest.raises(AllreduceException, match=r"min_compression=1\b.*min_compression=4"):
        PowerSGDEngine._check_tags(ours, group, [tag(ours.config), tag(PowerSGD(rank=4))])


def test_bytes_per_round_of_a_784x256_matrix():
    fp32_bytes = 784 * 256 * 4
    assert fp32_bytes == 802_816
    for rank, ratio in [(1, 192.80), (2, 96.45), (4, 48.23), (8, 24.12)]:
        values = PowerSGD(rank=rank).values_per_round([(784, 256)])
        assert values == rank * (784 + 256) + 1  # P (784·r), Q (256·r) and the group's weight
        assert fp32_bytes / (4 * values) == pytest.approx(ratio, abs=0.01)
    # an MLP 784-256-10: biases go as they are; the 10×256 layer is compressed too (4·266 = 1064 < 2560 values)
    shapes = [(256, 784), (256,), (10, 256), (10,)]
    assert PowerSGD(rank=4).values_per_round(shapes) == 4 * 1040 + 256 + 4 * 266 + 10 + 1


# --- orthogonalization ----------------------------------------------------------------------------------------------
def test_orthogonalize_gives_orthonormal_columns_for_a_well_conditioned_p():
    p = torch.randn(50, 4, generator=gen(0), dtype=F64)
    p_hat = orthogonalize(p)
    assert torch.allclose(p_hat.T @ p_hat, torch.eye(4, dtype=F64), atol=1e-12)
    # same span as p: projecting p onto it changes nothing
    assert torch.allclose(p_hat @ (p_hat.T @ p), p, atol=1e-12)


@pytest.mark.parametrize("case", ["zero", "zero_column", "duplicate_columns", "rank_one", "tiny", "huge"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_orthogonalize_degenerate_input_gives_no_nan_and_never_amplifies(case, dtype):
    base = torch.randn(30, 4, generator=gen(1), dtype=F64)
    p = {"zero": torch.zeros(30, 4, dtype=F64),
         "zero_column": torch.cat([base[:, :3], torch.zeros(30, 1, dtype=F64)], dim=1),
         "duplicate_columns": torch.cat([base[:, :2], base[:, :2]], dim=1),
         "rank_one": base[:, :1] @ torch.randn(1, 4, generator=gen(2), dtype=F64),
         "tiny": base * 1e-30, "huge": base * (1e30 if dtype == F64 else 1e18)}[case].to(dtype)
    p_hat = orthogonalize(p)
    assert p_hat.dtype == dtype and bool(torch.isfinite(p_hat).all())
    projector = (p_hat.double() @ p_hat.double().T)
    assert float(torch.linalg.eigvalsh(projector).max()) <= 1 + 1e-5  # a contraction: P̂P̂ᵀM never overshoots M
    if case == "zero":
        assert bool((p_hat == 0).all())


def test_orthogonalize_is_continuous_where_gram_schmidt_is_not():
    """Members of a group see the averaged P up to rounding. Where P is nearly rank-deficient, Gram-Schmidt (QR)
    normalises rounding noise into an arbitrary direction, so members would apply different updates; ours moves by
    about the perturbation over the floor δ."""
    good = torch.randn(40, 1, generator=gen(3), dtype=F64)
    p = torch.cat([good, good * (1 + 1e-12)], dim=1)  # the second column adds nothing but noise
    noise = torch.randn(40, 2, generator=gen(4), dtype=F64)
    eps = 1e-7 * float(p.norm())  # float32-sized disagreement between members
    q1, q2 = orthogonalize(p), orthogonalize(p + eps * noise / noise.norm())
    ours = float((q1 @ q1.T - q2 @ q2.T).norm())
    assert ours <= 4 * 1e-7 / ORTHOGONALIZATION_FLOOR
    r1, r2 = torch.linalg.qr(p)[0], torch.linalg.qr(p + eps * noise / noise.norm())[0]
    gram_schmidt = float((r1 @ r1.T - r2 @ r2.T).norm())
    assert gram_schmidt > 0.1, gram_schmidt


def test_orthogonalize_refuses_non_finite_input():
    with pytest.raises(ValueError, match="non-finite"):
        orthogonalize(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))


def test_unit_columns_rescales_and_redraws_dead_columns_deterministically():
    q = torch.tensor([[3.0, 0.0, 1e-3], [4.0, 0.0, 0.0]], dtype=F64)
    a, b = unit_columns(q, seed=5), unit_columns(q, seed=5)
    assert torch.equal(a, b)
    assert torch.allclose(torch.linalg.vector_norm(a, dim=0), torch.ones(3, dtype=F64))
    assert torch.allclose(a[:, 0], torch.tensor([0.6, 0.8], dtype=F64))
    assert not torch.equal(a[:, 1], unit_columns(q, seed=6)[:, 1])  # the dead column came from the seed


# --- rounds -----------------------------------------------------------------------------------------------------------
def test_full_rank_round_averages_exactly():
    """With rank = min(n, m) (never compressed in practice, see above) the maths itself is exact: the update is the
    weighted mean and the residuals sum to zero (each peer keeps what of its own share lies outside the mean's
    span, cancelling between peers)."""
    n, m, peers = 6, 4, 3
    group = Group(n, m, rank=4, peers=peers)
    grads = [torch.randn(n, m, generator=gen(10 + i), dtype=F64) for i in range(peers)]
    weights = [3.0, 5.0, 8.0]
    mean = sum(w * g for w, g in zip(weights, grads)) / sum(weights)
    for update in group.run(grads, weights):
        assert torch.allclose(update, mean, atol=1e-12)
    assert float(sum(group.residuals()).abs().max()) < 1e-12


def test_finish_writes_the_update_into_the_buffers_it_is_given():
    """The averager passes matrix views of its buffers as ``out``: the same update, in place, no model-sized copy."""
    shape, peers = (12, 10), 2
    results = []
    for in_place in (False, True):
        qs = initial_factors([shape], 2, seed=0, dtypes=[F64])
        grads = [torch.randn(*shape, generator=gen(20 + i), dtype=F64) for i in range(peers)]
        rounds = [PeerRound([g], [torch.zeros(shape, dtype=F64)], [torch.empty(shape, dtype=F64)], qs, weight=1.0)
                  for g in grads]
        p_means = [sum(ps) / peers for ps in zip(*(r.phase1() for r in rounds))]
        q_hats = [sum(q) for q in zip(*(r.phase2(p_means, float(peers)) for r in rounds))]
        outs = [[torch.empty(shape, dtype=F64)] if in_place else None for _ in rounds]
        updates = [r.finish(q_hats, out=out) for r, out in zip(rounds, outs)]
        if in_place:
            assert all(u[0].data_ptr() == out[0].data_ptr() for u, out in zip(updates, outs))
        results.append(updates[0][0])
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_a_round_applies_the_projection_of_the_true_mean_even_with_a_stale_member():
    """A member whose Q is not the group's sends zeros in phase 1; the update is still P̂P̂ᵀ of the exact weighted
    mean, identical on every member, and Σ residuals is exactly what was not sent."""
    n, m, peers = 20, 12, 3
    grads = [torch.randn(n, m, generator=gen(20 + i), dtype=F64) for i in range(peers)]
    weights = [1.0, 2.0, 3.0]
    q = initial_factors([(n, m)], 2, seed=0, dtypes=[F64])
    stale = [torch.randn(m, 2, generator=gen(99), dtype=F64)]
    feedback = [ErrorFeedback([(n, m)], [F64]) for _ in range(peers)]
    rounds = []
    for i in range(peers):
        residuals, shares = feedback[i].begin(1, -1, 0)
        rounds.append(PeerRound([grads[i]], residuals, shares, stale if i == 2 else q, weight=weights[i],
                                contributes=i != 2))
    updates, _, _ = simulate_round(rounds)
    mean = sum(w * g for w, g in zip(weights, grads)) / sum(weights)
    p_hat = rounds[0].p_hats[0]
    expected = p_hat @ p_hat.T @ mean
    for update in updates:
        assert torch.allclose(update[0], expected, atol=1e-12)
    leftover = sum(r.shares[0] for r in rounds)
    assert torch.allclose(leftover, mean - expected, atol=1e-12)


def test_winning_lineage_is_the_majority_then_the_oldest():
    assert _winning_lineage([(3, 7), (3, 7), (0, 1)]) == (3, 7)
    assert _winning_lineage([(3, 7), (0, 1)]) == (3, 7)  # a newcomer (generation 0) never wins a tie
    assert _winning_lineage([(3, 9), (3, 7)]) == (3, 7)
    assert _winning_lineage([(0, 1), (0, 1), (5, 2)]) == (0, 1)


@pytest.mark.parametrize("rank", [1, 2])
def test_error_feedback_keeps_every_gradient_over_many_rounds(rank):
    """Varying weights, random gradients, members missing rounds, rounds the hosts discard: the applied updates plus
    the residuals always sum to the sum of the committed rounds' weighted-mean gradients (nothing counted twice;
    the only loss is the residual of a peer that missed a committed round, which it drops like its gradients), and
    the residuals stay bounded (IID gradients)."""
    n, m, peers = 24, 16, 4
    group = Group(n, m, rank, peers)
    g = gen(30 + rank)
    applied = torch.zeros(n, m, dtype=F64)
    target = torch.zeros(n, m, dtype=F64)
    largest = 0.0
    for t in range(300):
        members = [i for i in range(peers) if t % 7 != i]  # one member sits out some rounds
        grads = [torch.randn(n, m, generator=g, dtype=F64) for _ in range(peers)]
        weights = [float(torch.randint(1, 64, (1,), generator=g)) for _ in range(peers)]
        commit = t % 5 != 3  # the host discards some rounds (and keeps its gradients: not counted)
        updates = group.run(grads, weights, commit=commit, members=members)
        for u in updates[1:]:
            assert torch.equal(u, updates[0])  # identical on every member (exact sums here)
        if commit:
            applied += updates[0]
            total = sum(weights[i] for i in members)
            target += sum(weights[i] * grads[i] for i in members) / total
            largest = max(largest, max(float(r.norm()) for r in group.residuals()))
    leftover = sum(group.residuals()) + group.dropped
    assert torch.allclose(applied + leftover, target, atol=1e-9), float((applied + leftover - target).abs().max())
    assert float(group.dropped.norm()) > 0  # the scenario did exercise the reset
    gradient_size = math.sqrt(n * m)  # ‖g‖ of one peer's standard normal gradient
    assert largest < 3 * gradient_size, largest  # bounded (a random walk would reach ~√300/4·‖g‖ ≈ 4.3‖g‖)


def test_a_discarded_round_leaves_the_residual_unchanged_and_a_gap_resets_it():
    fb = ErrorFeedback([(2, 3)], [F64])
    residuals, shares = fb.begin(round_id=1, committed_attempt=-1, committed_round=0)
    shares[0].fill_(1.0)
    fb.stage(attempt=10)
    residuals, shares = fb.begin(round_id=2, committed_attempt=10, committed_round=1)  # attempt 10 committed
    assert bool((residuals[0] == 1.0).all())
    shares[0].fill_(2.0)
    fb.stage(attempt=11)
    residuals, shares = fb.begin(round_id=2, committed_attempt=10, committed_round=1)  # 11 discarded: retry round 2
    assert bool((residuals[0] == 1.0).all())
    fb.stage(attempt=12)  # staged but the host ran the round alone instead (attempt -1, round 2)
    residuals, _ = fb.begin(round_id=3, committed_attempt=-1, committed_round=2)
    assert bool((residuals[0] == 1.0).all())  # no gap: the residual is still owed to the swarm
    residuals, _ = fb.begin(round_id=9, committed_attempt=-1, committed_round=2)  # caught up by downloading
    assert bool((residuals[0] == 0.0).all())


def test_heterogeneous_full_gradients_reach_the_exact_optimum():
    """Peers with different quadratics ½‖W − B_i‖²: error feedback at rank 1 reaches the optimum mean(B_i) exactly
    (compression without error feedback would stall), and the group's residual vanishes. Individual residuals do not:
    each holds what cancels between peers (noted in the module docstring)."""
    n, m, peers, lr = 16, 8, 3, 0.1
    targets = [torch.randn(n, m, generator=gen(40 + i), dtype=F64) for i in range(peers)]
    optimum = sum(targets) / peers
    w = torch.zeros(n, m, dtype=F64)
    group = Group(n, m, rank=1, peers=peers)
    for _ in range(600):
        update = group.run([w - b for b in targets], [1.0] * peers)[0]
        w -= lr * update
    assert float((w - optimum).norm()) < 1e-9 * float(optimum.norm())
    assert float(sum(group.residuals()).norm()) < 1e-8
    assert max(float(r.norm()) for r in group.residuals()) > 1e-3  # individual ones hold the cancelling parts
