"""Moshpit group averaging (swarm_opt.groups): the grid, the commit rule, the strategies that accept groups, and
SCAFFOLD's controls in partial groups, on the strategy code itself through swarm_opt.simulation (no network)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from swarm_opt import ConfigError, ConfigTypeError, Groups
from swarm_opt.buffers import AveragingResult
from swarm_opt.groups import ONE_GROUP, Grid, RoundPlan, cell_peers, grid_shape, line_peers
from swarm_opt.round import is_majority, line_seen_by
from swarm_opt.simulation import average_in_process, moshpit_groups, moshpit_round
from swarm_opt.strategies import DiLoCo, FedNova, FedProx, GradientAveraging, LocalUpdates, Scaffold
from tests.unit.test_scaffold_maths import DIM, Peer, optimum, problems


def test_groups_config_names_the_fix():
    assert Groups().size == 16
    with pytest.raises(ConfigError, match=r"size >= 2.*Groups\(size=16\).*groups=None"):
        Groups(size=1)
    with pytest.raises(ConfigTypeError, match="Groups\\(size=16\\)"):
        Groups(size="16")  # type: ignore[arg-type]
    with pytest.raises(ConfigTypeError):
        Groups(size=True)


@pytest.mark.parametrize("n, size, shape", [(1, 16, (1, 1)), (16, 16, (1, 16)), (17, 16, (2, 5)), (256, 16, (2, 16)),
                                             (1000, 16, (3, 10)), (1000, 32, (2, 32)), (4, 2, (2, 2)),
                                             (6, 2, (3, 2)), (64, 4, (3, 4)), (50, None, (1, 50))])
def test_grid_shape_is_the_fewest_dimensions_of_at_most_size(n, size, shape):
    dims, side = grid_shape(n, size)
    assert (dims, side) == shape
    assert side ** dims >= n and (size is None or side <= size)


def test_a_small_swarm_is_one_group_with_the_old_majority_rule():
    for grid in (Grid(None, "a"), Grid(16, "a")):
        plan = grid.plan(round_id=7, num_peers=10)
        assert (plan.dims, plan.cell, plan.whole_swarm) == (1, "", True)
    assert ONE_GROUP.whole_swarm and ONE_GROUP.cell == ""
    for n, g in itertools.product(range(1, 17), range(1, 17)):
        plans = (Grid(16, "a").plan(7, n), Grid(None, "a").plan(7, n), ONE_GROUP)
        assert {is_majority(g, cell_peers(n, plan)) for plan in plans} == {is_majority(g, n)}


def test_commit_rule_is_a_majority_of_the_line():
    plan = Grid(16, "a").plan(1, 1000)
    assert cell_peers(1000, plan) == 10  # 10 x 10 x 10 grid: lines of 10
    assert is_majority(6, cell_peers(1000, plan)) and not is_majority(5, cell_peers(1000, plan))
    assert not is_majority(16, 1000)  # the old rule would never let a group of 16 commit in a swarm of 1,000


def test_a_line_short_of_its_share_needs_a_majority_of_the_peers_its_leader_counted():
    """A line of the grid holds a random number of peers: one short of its expected share is measured against its
    leader's count of the peers declared in it, never below the group itself, never above the expected share (a
    crowded line keeps the expected share's majority); without groups the count changes nothing."""
    plan = RoundPlan(dimension=0, dims=2, side=5, cell="0101")
    assert cell_peers(24, plan) == 5 and line_peers(24, plan) == 5
    assert line_peers(24, plan, declared=3, group_size=2) == 3 and is_majority(2, 3)  # 2 of 3 commits...
    assert not is_majority(2, line_peers(24, plan))  # ...where 2 of an expected 5 did not
    assert line_peers(24, plan, declared=1, group_size=2) == 2  # a count below the group is not believed
    assert line_peers(24, plan, declared=9, group_size=4) == 5  # a crowded line: the expected share's majority
    assert line_peers(24, ONE_GROUP, declared=3, group_size=2) == 24  # one group: every live peer


def test_members_take_the_line_count_from_the_gather_alike():
    """The count travels in the gather (the leader's; the largest if several members sent one); counts that are
    not positive integers are ignored, so a malformed gather falls back to the expected share."""
    plan = RoundPlan(dimension=1, dims=2, side=5, cell="1011")

    def result(*lines: object) -> AveragingResult:
        gathered = {f"p{i}": ({"line": line} if line is not None else {}) for i, line in enumerate(lines)}
        return AveragingResult(peers=tuple(gathered), gathered=gathered)

    assert line_seen_by(result(3, None), plan, 24) == 3
    assert line_seen_by(result(None, None), plan, 24) == 5
    assert line_seen_by(result(2, 4, None), plan, 24) == 4
    for bad in (0, -3, 2.5, True, "3", 10**9):
        assert line_seen_by(result(bad, None), plan, 24) == 5, bad
    assert line_seen_by(result(3, None), ONE_GROUP, 24) == 24


def test_a_line_grows_with_the_count_it_is_measured_against():
    """A group's members may count more live peers than the plan was drawn for (each sends its own count; the
    largest counts): the line is measured on the plan's grid, so its expected size never shrinks as the count grows,
    even past the count where a finer grid would be drawn (1,024 fills 32 x 32; 1,025 would draw 11 x 11 x 11)."""
    plan = Grid(32, "a").plan(1, 1024)
    assert (plan.dims, plan.side) == (2, 32) and cell_peers(1024, plan) == 32
    lines = [cell_peers(n, plan) for n in range(1000, 1400)]
    assert lines == sorted(lines) and cell_peers(1025, plan) == 33
    assert cell_peers(1025, Grid(32, "a").plan(1, 1025)) == 9  # the finer grid a count of 1,025 draws


def test_rounds_alternate_dimensions_and_lines_name_the_other_coordinates():
    grids = [Grid(4, i) for i in range(64)]
    plans = [[g.plan(r, 64) for g in grids] for r in range(3)]
    assert {p.dimension for p in plans[0]} == {0} and {p.dimension for p in plans[1]} == {1}
    assert {len(p.cell) for row in plans for p in row} == {6}  # dimension (2 bits), 16 lines of a 4 x 4 x 4 grid (4)
    assert not {p.cell for p in plans[0]} & {p.cell for p in plans[1]}  # a round behind never meets this round
    again = Grid(4, 0)
    assert again.plan(1, 64) == grids[0].plan(1, 64)  # coordinates come from the seed (the peer id)
    assert again.plan(1, 5000) == again.plan(1, 64)  # one plan per round, whatever the count meanwhile


def _equal_weight_peers(values):
    """LocalUpdates peers holding ``values`` (one row each), each with one zero-lr step (weight 1) per round."""
    peers = []
    for row in values:
        w = torch.nn.Parameter(row.clone())
        strategy = LocalUpdates()
        strategy.bind([w], torch.optim.SGD([w], lr=0.0))
        peers.append((w, strategy))
    return peers


def _step(peers):
    for w, strategy in peers:
        w.grad = torch.zeros_like(w)
        assert strategy.local_step(1)


def test_complete_grid_gives_the_exact_mean_after_dims_rounds():
    side, dims = 4, 3
    values = torch.randn(side ** dims, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    peers = _equal_weight_peers(values)
    ids = list(range(len(peers)))
    grids = [Grid(side, i) for i in ids]
    for i, grid in enumerate(grids):  # one peer per cell
        for j in range(dims):
            grid.coords[j] = (i // side ** j) % side
    mean = values.mean(0)
    for r in range(dims):
        spread = max(float((w.detach() - mean).abs().max()) for w, _ in peers)
        assert spread > 1e-3, f"round {r}: the mean is reached too early (the groups are not partial)"
        _step(peers)
        committed, failed = moshpit_round([s for _, s in peers], grids, ids, r)
        assert not failed and sorted(len(g) for g in committed) == [side] * side ** (dims - 1)
    for w, _ in peers:
        torch.testing.assert_close(w.detach(), mean, atol=1e-12, rtol=0)


def test_random_grid_with_churn_decays_geometrically_to_the_swarm_mean():
    """Peers start at random coordinates (lines fill unevenly, some groups fail); every round 10 % of the peers
    leave and as many newcomers join holding the current swarm mean. The spread around the mean (rms) shrinks by
    a constant factor per round."""
    n, size = 256, 8
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(n, 3, dtype=torch.float64, generator=gen)
    peers = _equal_weight_peers(values)
    ids = list(range(n))
    grids = [Grid(size, i) for i in ids]
    next_id = n
    spreads = []
    for r in range(16):
        _step(peers)
        moshpit_round([s for _, s in peers], grids, ids, r)
        stacked = torch.stack([w.detach() for w, _ in peers])
        spreads.append(float((stacked - stacked.mean(0)).norm(dim=1).pow(2).mean().sqrt()))
        leaving = torch.randperm(n, generator=gen)[: n // 10].tolist()
        mean = stacked.mean(0)
        for i in leaving:
            peers[i] = _equal_weight_peers(mean[None])[0]
            ids[i], grids[i] = next_id, Grid(size, next_id)
            next_id += 1
    assert spreads[-1] < 1e-3 * spreads[0], spreads
    assert all(b < a for a, b in zip(spreads, spreads[1:])), spreads  # every round: fewer than a few groups fail


def test_every_strategy_but_fednova_accepts_groups():
    """GradientAveraging's rounds then carry the parameters too (tests/unit/test_grad_averaging_groups.py)."""
    groups = Groups(size=8)
    for strategy in (GradientAveraging(), LocalUpdates(), FedProx(mu=0.1), Scaffold(),
                     DiLoCo(lambda p: torch.optim.SGD(p, lr=0.7))):
        strategy.use_groups(groups)
    with pytest.raises(ConfigError, match="anchor x.*LocalUpdates.*DiLoCo.*groups=None"):
        FedNova().use_groups(groups)


@pytest.mark.parametrize("outer", [lambda p: torch.optim.Adam(p, lr=0.1),
                                   lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, dampening=0.1)])
def test_diloco_in_groups_refuses_an_outer_step_that_is_not_linear_in_its_state(outer):
    strategy = DiLoCo(outer)
    strategy.use_groups(Groups(size=4))
    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match=r"DiLoCo in groups.*torch.optim.SGD.*dampening=0.*groups=None"):
        strategy.bind([w], torch.optim.SGD([w], lr=0.1))


def _nesterov(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _diloco_peers(probs, groups):
    peers = []
    for problem in probs:
        strategy = DiLoCo(_nesterov)
        if groups is not None:
            strategy.use_groups(groups)
        peers.append(Peer(strategy, problem, lr=0.05))
    return peers


def test_diloco_in_groups_moves_the_swarms_mean_as_one_diloco_over_the_swarm():
    """16 peers on a complete 4 x 4 grid, groups of 4, quadratics of one curvature and different optima (local SGD
    is then affine in its start with one matrix for all), full gradients, outer Nesterov SGD. Each round's groups
    average x and the outer momentum with the parameters: every group ends identical, the groups differ, and the
    swarm's mean is exactly where one DiLoCo of the whole swarm is."""
    n, side = 16, 4
    a = problems(1)[0][0]
    probs = [(a, b) for _, b in problems(n, seed=3)]
    grouped, whole = _diloco_peers(probs, Groups(size=side)), _diloco_peers(probs, None)
    assert grouped[0].strategy.variant == "+changes+groups+momentum" and whole[0].strategy.variant == "+changes"
    assert len(grouped[0].strategy.buffer_templates()) == 3 * len(whole[0].strategy.buffer_templates())
    grids = [Grid(side, i) for i in range(n)]
    for i, grid in enumerate(grids):
        for j in range(2):
            grid.coords[j] = (i // side ** j) % side
    ids = list(range(n))
    for r in range(12):
        for peer in grouped + whole:
            peer.local_steps(5)
        committed, failed = moshpit_round([p.strategy for p in grouped], grids, ids, r)
        assert not failed and len(committed) == side
        average_in_process([p.strategy for p in whole])
        for group in committed:
            for i in group[1:]:
                torch.testing.assert_close(grouped[i].w.detach(), grouped[group[0]].w.detach(), atol=1e-12, rtol=0)
        mean = torch.stack([p.w.detach() for p in grouped]).mean(0)
        torch.testing.assert_close(mean, whole[0].w.detach(), atol=1e-10, rtol=1e-10)
        spread = float(torch.stack([p.w.detach() for p in grouped]).std(0).max())
        assert spread > 1e-6, f"round {r}: the groups are not partial"


def _scaffold_swarm(cls, n, size, complete=True):
    probs = problems(n)
    peers = [Peer(cls(), p, lr=0.005) for p in probs]  # the stiffest of 16 problems needs lr < 0.01
    grids = [Grid(size, i) for i in range(n)]
    if complete:
        dims, side = grid_shape(n, size)
        for i, grid in enumerate(grids):
            for j in range(dims):
                grid.coords[j] = (i // side ** j) % side
    return probs, peers, grids


def test_scaffold_in_partial_groups_keeps_the_controls_summing_to_zero_and_reaches_the_optimum():
    """16 heterogeneous quadratics on a 4 x 4 grid, groups of 4, full gradients. K-GT rounds keep each group's
    Σ d and hence the swarm's at 0 after every round (while single groups' sums are not 0: the controls carry the
    other lines' gradients), and SCAFFOLD reaches the swarm's optimum; FedAvg in the same groups does not."""
    n, size = 16, 4
    probs, peers, grids = _scaffold_swarm(Scaffold, n, size)
    ids = list(range(n))
    group_sums = []
    for r in range(120):
        for peer in peers:
            peer.local_steps(10)
        committed, failed = moshpit_round([p.strategy for p in peers], grids, ids, r)
        assert not failed and len(committed) == 4
        total = sum(p.strategy.controls[0] for p in peers)
        scale = float(sum(p.strategy.controls[0].abs() for p in peers).max())
        assert float(total.abs().max()) <= 1e-12 * scale, f"round {r}: Σ d = {total} (Σ |d| = {scale})"
        group_sums.append(max(float(sum(peers[i].strategy.controls[0] for i in g).abs().max()) for g in committed))
    assert max(group_sums[-10:]) > 1e-3  # per group the sum is not 0: a control holds more than its group's view
    target = optimum(probs)
    scaffold_error = max(float((p.w.detach() - target).norm()) for p in peers)
    assert scaffold_error < 1e-6, scaffold_error
    assert max(float(p.strategy.controls[0].abs().max()) for p in peers) > 1e-2  # not silently FedAvg

    _, fedavg, grids = _scaffold_swarm(LocalUpdates, n, size)
    for r in range(120):
        for peer in fedavg:
            peer.local_steps(10)
        moshpit_round([p.strategy for p in fedavg], grids, ids, r)
    fedavg_error = max(float((p.w.detach() - target).norm()) for p in fedavg)
    assert fedavg_error > 100 * max(scaffold_error, 1e-8), (fedavg_error, scaffold_error)


def test_scaffold_controls_after_a_pass_are_the_swarms_correction():
    """With the parameters held fixed (lr 0 steps do not move; the gradients are stationary), one pass over a
    complete grid's dimensions gives every peer d_i = mean(g) - g_i, as one group of the whole swarm would."""
    n, size = 16, 4
    probs, peers, grids = _scaffold_swarm(Scaffold, n, size)
    for peer in peers:
        peer.inner.param_groups[0]["lr"] = 1e-12  # z_i = mean corrected gradient, the parameters barely move
    ids = list(range(n))
    for r in range(2):
        for peer in peers:
            peer.local_steps(1)
        moshpit_round([p.strategy for p in peers], grids, ids, r)
    grads = [a.T @ (a @ torch.zeros(DIM, dtype=torch.float64) - b) for a, b in probs]
    mean = sum(grads) / n
    for peer, g in zip(peers, grads):
        torch.testing.assert_close(peer.strategy.controls[0], mean - g, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n, size", [(4, 2), (9, 3), (16, 4), (24, 5), (64, 4)])
def test_peers_that_see_the_same_live_peers_fill_every_line_evenly(n, size):
    """With random coordinates a line holds a binomial number of peers: in 4 peers on a 2 x 2 grid, a line of one
    (which finds no group) in most rounds; a real swarm of 4 then lost every other round. Peers that know every live
    peer take the cells of their ranks: each round's lines hold the same numbers of peers (one less in a line
    where the grid is not full), and a new order each block of ``dims`` rounds. Views that do not hold the peer (a
    sample) fall back to the random coordinates."""
    ids = [f"peer-{i}".encode() for i in range(n)]
    ranked = [Grid(size, peer, live_peers=lambda: ids) for peer in ids]
    random_lines = []
    for round_id in range(12):
        plans, committing, failing = moshpit_groups(ranked, ids, round_id)
        sizes = Counter(plan.cell for plan in plans).values()
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 2, sorted(sizes)
        assert not failing and sum(map(len, committing)) == n
        random_plans, _, _ = moshpit_groups([Grid(size, peer) for peer in ids], ids, round_id)
        random_lines.append(Counter(plan.cell for plan in random_plans).values())
    assert any(max(sizes) - min(sizes) > 1 for sizes in random_lines)  # what the ranks spare
    dims, _ = grid_shape(n, size)
    blocks = [[Grid(size, peer, live_peers=lambda: ids).plan(round_id, n).cell for peer in ids]
              for round_id in (0, dims)]
    assert blocks[0] != blocks[1]  # the same dimension, another block: other lines
    assert Grid(size, b"stranger", live_peers=lambda: ids).plan(1, n).cell == Grid(size, b"stranger").plan(1, n).cell


def test_ranked_lines_give_the_exact_mean_after_dims_rounds():
    side, dims = 3, 2
    values = torch.randn(side ** dims, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    peers = _equal_weight_peers(values)
    ids = [f"peer-{i}".encode() for i in range(len(peers))]
    grids = [Grid(side, peer, live_peers=lambda: ids) for peer in ids]
    for r in range(dims):  # one block
        _step(peers)
        committed, failed = moshpit_round([s for _, s in peers], grids, ids, r)
        assert not failed and sorted(len(g) for g in committed) == [side] * side ** (dims - 1)
    for w, _ in peers:
        torch.testing.assert_close(w.detach(), values.mean(0), atol=1e-12, rtol=0)


def test_failing_groups_change_nothing():
    grids = [Grid(16, i) for i in range(1000)]
    plans, committing, failing = moshpit_groups(grids, list(range(1000)), round_id=0)
    assert failing, "a line beyond 16 peers leaves a remainder short of a majority, a line of one finds no group"
    assert all(len(g) <= 16 for g in committing + failing)
    lines = {p.cell: sum(q.cell == p.cell for q in plans) for p in plans}
    assert any(len(g) < 6 for g in committing), "lines short of their share of 10 commit what they hold"
    for group in committing + failing:
        line = min(cell_peers(1000, plans[group[0]]), lines[plans[group[0]].cell])
        assert (group in committing) == (len(group) > 1 and is_majority(len(group), line)), group
    assert {len(p.cell) for p in plans} == {2 + 7}  # dimension of 3: 2 bits; 100 lines: 7 bits


def test_absent_peers_keep_their_values_and_move_to_a_new_line():
    """A peer that misses its round (too late for its group) averages with nobody and draws a new coordinate, as
    after a failed round; the others' groups form without it."""
    side, dims = 4, 2
    values = torch.arange(side ** dims, dtype=torch.float64)[:, None].repeat(1, 3)
    peers = _equal_weight_peers(values)
    ids = list(range(len(peers)))
    grids = [Grid(side, i) for i in ids]
    for i, grid in enumerate(grids):
        for j in range(dims):
            grid.coords[j] = (i // side ** j) % side
    before = [list(grid.coords) for grid in grids]
    _step(peers)
    committed, failed = moshpit_round([s for _, s in peers], grids, ids, 0, absent={0, 5})
    assert [0] in failed and [5] in failed and not any(0 in g or 5 in g for g in committed)
    assert sorted(len(g) for g in committed) == [3, 3, 4, 4]  # lines of 4 less the absent, a majority of 4
    for i in (0, 5):
        torch.testing.assert_close(peers[i][0].detach(), values[i])
        assert grids[i].coords != before[i]  # a new line next round
    assert not torch.equal(peers[1][0].detach(), values[1])
