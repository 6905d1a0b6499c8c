"""TopK's selection with error feedback (``swarm_opt.compression.sparse``): what a round leaves out is delivered by
later rounds, with its own weight; rounds that were not applied change nothing; refusals of what TopK cannot serve."""

from __future__ import annotations

import pytest
import torch

import swarm_opt
from swarm_opt.aggregation import as_aggregation
from swarm_opt.compression import as_codec
from swarm_opt.compression.sparse import SparseFeedback, select_top_k, top_k_count
from swarm_opt.errors import ConfigError
from swarm_opt.simulation import average_in_process
from tests.unit.test_scaffold_maths import Peer, problems

SHAPES = [(40, 25), (25,)]
FRACTION = 0.05


def _values(generator: torch.Generator):
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES]


def _round(feedback: SparseFeedback, values, weight: float, round_id: int):
    buffers = [v.clone() for v in values]
    feedback.select(buffers, weight, round_id)
    return buffers


def test_error_feedback_delivers_in_later_rounds_what_earlier_rounds_left_out():
    """Three peers, weights changing every round: after each committed round Σ w·sent + R = Σ w·x for every peer;
    rounds with nothing new then deliver the rest, and the swarm has applied exactly the sum of what was written."""
    g = torch.Generator().manual_seed(0)
    peers = [SparseFeedback([torch.zeros(s, dtype=torch.float64) for s in SHAPES], FRACTION) for _ in range(3)]
    written = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in peers]
    sent = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in peers]
    applied = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]  # Σ over rounds of W · the group's mean
    rounds_to_empty = max(-(-torch.Size(s).numel() // top_k_count(torch.Size(s).numel(), FRACTION)) for s in SHAPES)
    for round_id in range(1, 6 + rounds_to_empty + 1):
        fresh = round_id <= 6
        outputs = []
        for i, peer in enumerate(peers):
            weight = float(10 + 7 * i + 3 * round_id)  # a peer's share of the weight changes every round
            values = _values(g) if fresh else [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
            buffers = _round(peer, values, weight, round_id)
            for t, (x, b) in enumerate(zip(values, buffers)):
                k = top_k_count(b.numel(), FRACTION)
                assert int((b != 0).sum()) <= k, "more than k values sent"
                written[i][t] += weight * x
                sent[i][t] += weight * b
            outputs.append((weight, buffers))
        total = sum(w for w, _ in outputs)
        for t in range(len(SHAPES)):  # what every member applies: W · the weighted mean of the sparse values
            applied[t] += total * sum(w * b[t] for w, b in outputs) / total
        for i, peer in enumerate(peers):
            peer.commit(round_id, averaged=True)
            for t in range(len(SHAPES)):
                torch.testing.assert_close(sent[i][t] + peer.residuals[t], written[i][t], rtol=0, atol=1e-10)
        if round_id == 6:  # something was left out: the test is not trivially exact
            assert all(float(p.residuals[0].abs().max()) > 0.1 for p in peers)
    for t in range(len(SHAPES)):
        assert all(float(p.residuals[t].abs().max()) < 1e-12 for p in peers), "residuals not delivered"
        torch.testing.assert_close(applied[t], sum(w[t] for w in written), rtol=0, atol=1e-9)


def test_selection_keeps_the_largest_magnitudes_of_values_plus_residual():
    values = torch.tensor([0.1, -3.0, 0.2, 2.0, -0.05])
    residual = torch.tensor([0.0, 0.0, 8.0, 0.0, 0.0])  # 8 at weight 2: +4 to the third value
    left_out = torch.empty(5)
    select_top_k(values, residual, left_out, weight=2.0, k=2)
    assert values.tolist() == [0.0, -3.0, pytest.approx(4.2), 0.0, 0.0]
    assert left_out.tolist() == [pytest.approx(0.2), 0.0, 0.0, 4.0, pytest.approx(-0.1)]


def test_rounds_not_applied_change_nothing_and_a_retry_selects_the_same():
    g = torch.Generator().manual_seed(1)
    peer = SparseFeedback([torch.zeros(s, dtype=torch.float64) for s in SHAPES], FRACTION)
    _round(peer, _values(g), 5.0, 1)
    peer.commit(1, averaged=True)
    residual = [r.clone() for r in peer.residuals]
    values = _values(g)
    first = _round(peer, values, 5.0, 2)  # the all-reduce fails, or its group was a minority: no commit
    assert all(torch.equal(r, before) for r, before in zip(peer.residuals, residual))
    retry = _round(peer, values, 5.0, 2)
    assert all(torch.equal(a, b) for a, b in zip(first, retry))
    peer.commit(2, averaged=False)  # the retry failed too and the peer applied round 2 alone: R is still owed
    assert all(torch.equal(r, before) for r, before in zip(peer.residuals, residual))
    _round(peer, _values(g), 5.0, 3)
    peer.commit(3, averaged=True)
    assert not all(torch.equal(r, before) for r, before in zip(peer.residuals, residual))


def test_a_peer_that_missed_a_round_drops_its_residual():
    g = torch.Generator().manual_seed(2)
    peer = SparseFeedback([torch.zeros(s, dtype=torch.float64) for s in SHAPES], FRACTION)
    _round(peer, _values(g), 5.0, 1)
    peer.commit(1, averaged=True)
    values = _values(g)
    sent = _round(peer, values, 5.0, 4)  # rounds 2 and 3 went on without it (it downloaded the swarm's state)
    expected = [v.clone() for v in values]
    select_top_k(expected[0], torch.zeros_like(expected[0]), torch.empty_like(expected[0]), 5.0,
                 top_k_count(expected[0].numel(), FRACTION))
    assert torch.equal(sent[0], expected[0])


def _fedavg(**kwargs) -> swarm_opt.DiLoCo:  # DiLoCo with an outer SGD of lr 1 is FedAvg
    return swarm_opt.DiLoCo(lambda p: torch.optim.SGD(p, lr=1.0), **kwargs)


def test_topk_refuses_strategies_and_aggregations_it_cannot_serve():
    with pytest.raises(ConfigError, match="GradientAveraging.*DiLoCo"):
        as_codec(swarm_opt.TopK(), swarm_opt.LocalUpdates())
    with pytest.raises(ConfigError, match="GradientAveraging"):
        as_codec(swarm_opt.TopK(), swarm_opt.Scaffold())
    with pytest.raises(ConfigError, match="without groups, average_optimizer_state"):
        as_codec(swarm_opt.TopK(), _fedavg(average_optimizer_state=("momentum_buffer",)))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)  # frozen but handed to the optimizer: no anchor, its value would be sparsified
    frozen = _fedavg()
    frozen.bind(list(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="frozen parameters"):
        as_codec(swarm_opt.TopK(), frozen)
    trainable = _fedavg()
    trainable.bind(list(model[1].parameters()), torch.optim.SGD(model[1].parameters(), lr=0.1))
    assert as_codec(swarm_opt.TopK(0.1), trainable) == swarm_opt.TopK(0.1)
    grouped = _fedavg()
    grouped.use_groups(swarm_opt.Groups(size=4))
    with pytest.raises(ConfigError, match="model states"):
        as_codec(swarm_opt.TopK(), grouped)
    assert as_codec(swarm_opt.TopK(0.1), swarm_opt.GradientAveraging()) == swarm_opt.TopK(0.1)
    assert as_codec(swarm_opt.TopK(0.1), _fedavg()) == swarm_opt.TopK(0.1)
    with pytest.raises(ConfigError, match="Leave aggregation unset"):
        as_aggregation(swarm_opt.TrimmedMean(), swarm_opt.TopK())
    assert isinstance(as_aggregation(None, swarm_opt.TopK()), swarm_opt.Mean)


def _fedavg_peers(probs, fraction):
    peers = [Peer(_fedavg(), problem, lr=0.05) for problem in probs]
    feedbacks = None if fraction is None else \
        [SparseFeedback(p.strategy.buffer_templates(), fraction) for p in peers]
    return peers, feedbacks


def test_diloco_sends_pseudo_gradients_that_topk_sparsifies_by_change_with_error_feedback():
    """FedAvg (DiLoCo, outer SGD lr 1) of 4 peers on heterogeneous quadratics: rounds send each peer's change since
    the last round, x - y. Whole (fraction 1) it equals FedAvg on the parameters; sparse (1 of 5 values per round)
    every peer ends every round identical, and error feedback delivers what rounds left out: the swarm circles
    FedAvg's fixed point (each peer's own change there is not zero, so its residual comes and goes) and its mean
    over rounds sits on it, where dropping the left-out changes instead stalls far from it."""
    probs = problems(4)
    reference = [Peer(swarm_opt.LocalUpdates(), problem, lr=0.05) for problem in probs]
    whole, whole_feedback = _fedavg_peers(probs, 1.0)
    sparse, sparse_feedback = _fedavg_peers(probs, 0.2)
    dropped, dropping = _fedavg_peers(probs, 0.2)
    rounds, window = 300, 100
    mean = torch.zeros_like(sparse[0].w.detach())
    for r in range(rounds):
        for peer in reference + whole + sparse + dropped:
            peer.local_steps(5)
        average_in_process([p.strategy for p in reference])
        average_in_process([p.strategy for p in whole], feedbacks=whole_feedback, round_id=r)
        average_in_process([p.strategy for p in sparse], feedbacks=sparse_feedback, round_id=r)
        average_in_process([p.strategy for p in dropped], feedbacks=dropping, round_id=r)
        for feedback in dropping:  # no error feedback: what a round leaves out is lost
            for residual in feedback.residuals:
                residual.zero_()
        for peers in (whole, sparse):
            for peer in peers[1:]:
                assert torch.equal(peer.w, peers[0].w), r
        if r < 20:
            torch.testing.assert_close(whole[0].w.detach(), reference[0].w.detach(), atol=1e-12, rtol=0)
        if r >= rounds - window:
            mean += sparse[0].w.detach() / window
    target = reference[0].w.detach()
    error = float((mean - target).norm())
    assert error < 0.05 * float(target.norm()), error
    assert float((dropped[0].w.detach() - target).norm()) > 10 * error
