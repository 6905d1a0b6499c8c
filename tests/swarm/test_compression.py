"""Codecs in real loopback swarms: three lockstep peers on heterogeneous least-squares problems (float64), with
gradient averaging and with local updates, must end within a distance of the exact (uncompressed, in-process)
trajectory that follows from the codec's stated error bound.

Why a bound and not a tolerance picked by hand: in a round, every peer receives the same values, the exact weighted
mean plus e with |e|∞ ≤ ε·M, where ε is the codec's ``nominal_error`` and M = max_k absmax(x_k) + absmax(mean): the
reducer decodes every sender's tensor x_k (each off by ≤ ε·absmax(x_k), so their mean too) and encodes the mean once
for every member (off by ≤ ε·absmax(mean), up to ε² terms). On least squares every step is affine with linear part
I − ηH_k, whose 2-norm is ≤ 1 (checked below), so a deviation never grows through the steps and the injected errors
add up:

* local updates average parameters: D' ≤ D + √d·ε·M (D: the largest ‖w_i − w_ref‖₂ over peers);
* gradient averaging averages g_k = H_k w_k − c_k and every peer applies the same mean: D' ≤ D + η√d·ε·M.

Peers must end every round with identical values, bit for bit, whatever the codec: hivemind's reducers send each
member its own encoded difference to the mean, so members of a gradient-averaging swarm (never re-synchronised)
drifted apart (8-bit: 2e-2 after 50 epochs).

M is taken from the exact trajectory and widened by what the run may deviate from it (3·L·D, L = 1 for
parameters, max‖H_k‖ for gradients), so the bound holds for the compressed run itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

import pytest
import torch

import swarm_opt
from swarm_opt.simulation import average_in_process, round_values
from tests.swarm.peer import LSQ_DIM, lsq_optimum, lsq_problem

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

PEERS, EPOCHS, STEPS, LR, BATCH = 3, 5, 10, 0.05, 16
LOCKSTEP = dict(task="lsq", batch_size=BATCH, steps_per_round=STEPS, target_batch_size=PEERS * BATCH * STEPS,
                epochs=EPOCHS, step_sleep=0.005, matchmaking_time=5.0, averaging_timeout=20.0, max_extrapolation=0.0)
#: the codecs encode in float32; the peers' buffers and the reducers' sums are float64 here
FP32_ULPS = 4 * torch.finfo(torch.float32).eps


@dataclass
class Reference:
    w: torch.Tensor  # the exact weights after the last round
    magnitudes: List[float]  # M of each round (see the module docstring), on the exact trajectory


def reference_run(strategy_cls: type) -> Reference:
    """The same strategy code, averaged in-process without compression, recording what each round averages."""
    peers = []
    for rank in range(PEERS):
        w = torch.nn.Parameter(torch.zeros(1, LSQ_DIM, dtype=torch.float64))
        inner = torch.optim.SGD([w], lr=LR)
        strategy = strategy_cls()
        strategy.bind([w], inner)
        peers.append((w, inner, strategy, lsq_problem(rank)))
    magnitudes = []
    for _ in range(EPOCHS):
        for w, inner, strategy, (a, b) in peers:
            for _ in range(STEPS):
                inner.zero_grad()
                (0.5 * (a @ w[0] - b).pow(2).sum()).backward()
                strategy.local_step(BATCH)
        sent = [torch.cat([t.reshape(-1) for t in round_values(s)]) for _, _, s, _ in peers]
        mean = sum(sent) / len(sent)
        magnitudes.append(max(float(x.abs().max()) for x in sent) + float(mean.abs().max()))
        average_in_process([s for _, _, s, _ in peers])
    return Reference(w=peers[0][0].detach()[0].clone(), magnitudes=magnitudes)


def derived_bound(epsilon: float, magnitudes: List[float], gradients: bool) -> float:
    """The largest distance of a peer from the exact weights after the last round."""
    hessians = [a.T @ a for a, _ in (lsq_problem(r) for r in range(PEERS))]
    for h in hessians:  # the steps do not amplify a deviation (the premise of the bound)
        assert float(torch.linalg.matrix_norm(torch.eye(LSQ_DIM, dtype=h.dtype) - LR * h, ord=2)) <= 1.0
    lipschitz = max(float(torch.linalg.matrix_norm(h, ord=2)) for h in hessians) if gradients else 1.0
    distance = 0.0
    for m in magnitudes:
        injected = math.sqrt(LSQ_DIM) * epsilon * (m + 3 * lipschitz * distance)
        distance += LR * injected if gradients else injected
    return distance


def run_swarm(swarm, strategy: str, codec: str) -> list:
    for rank in range(PEERS):
        swarm.start(rank, strategy=strategy, compression=codec, expect_peers=PEERS, **LOCKSTEP)
    swarm.wait(timeout=240)
    return [swarm.result(r) for r in range(PEERS)]


def check_rounds(swarm, results: list, strategy: str) -> None:
    """Every round averaged all three (the premise of the bound). With gradient averaging, a peer whose side of a
    round failed after the others had used its tensors downloads the result, which cannot widen the bound: its
    parameters change only in rounds, so it adopts exactly a groupmate's. With local updates such a peer goes on
    from its own state (its work is averaged in again next round), which the bound does not cover: none allowed."""
    downloads = 0
    for r in results:
        assert r["epoch"] == EPOCHS, (r["rounds"], swarm.round_events())
        for rnd in r["rounds"]:
            downloads += rnd["caught_up"]
            complete = rnd["group_size"] == PEERS or (strategy == "grad" and rnd["caught_up"])
            assert complete, (r["rounds"], swarm.round_events())
            assert bool(torch.isfinite(rnd["w"]).all())
    assert downloads <= 2, ([r["rounds"] for r in results], swarm.round_events())


# each codec and each kind of strategy once by default; the other two pairings are extended (CI budget)
@pytest.mark.parametrize("codec, strategy, strategy_cls", [
    ("Float16", "grad", swarm_opt.GradientAveraging),
    pytest.param("Int8Blockwise", "local", swarm_opt.LocalUpdates, marks=pytest.mark.extended),
    pytest.param("Int8Blockwise", "grad", swarm_opt.GradientAveraging, marks=pytest.mark.extended),
    pytest.param("Float16", "local", swarm_opt.LocalUpdates, marks=pytest.mark.extended)],
    ids=["Float16-grad", "Int8Blockwise-local", "Int8Blockwise-grad", "Float16-local"])
def test_compressed_swarm_stays_within_the_codec_bound(swarm, codec, strategy, strategy_cls):
    results = run_swarm(swarm, strategy, codec)
    check_rounds(swarm, results, strategy)
    reference = reference_run(strategy_cls)
    epsilon = getattr(swarm_opt, codec)().nominal_error + FP32_ULPS
    max_distance = derived_bound(epsilon, reference.magnitudes, gradients=strategy == "grad")
    distance = max(float((r["w"] - reference.w).norm()) for r in results)
    by_epoch = [{rnd["epoch"]: rnd["w"] for rnd in r["rounds"]} for r in results]
    print(f"{codec}/{strategy}: distance to exact {distance:.3g} (bound {max_distance:.3g}), |w| "
          f"{float(reference.w.norm()):.3g}")
    assert distance <= max_distance
    for epoch in range(1, EPOCHS + 1):  # every member got the same bytes and decoded them the same way
        values = [weights[epoch] for weights in by_epoch if epoch in weights]
        assert all(torch.equal(values[0], v) for v in values), f"peers differ after round {epoch}"
    assert all(torch.equal(results[0]["w"], r["w"]) for r in results)
    # the codec was on the wire: uncompressed swarms match the exact trajectory to float32 round-off (1e-6)
    assert distance > 1e-6
    assert float(reference.w.norm()) > 1.0  # and the run trained


TOPK_FRACTION, TOPK_EPOCHS = 0.2, 6  # one value of LSQ_DIM = 5 per peer and round


def topk_reference() -> List[torch.Tensor]:
    """TopK's maths in-process (``swarm_opt.compression.sparse``), the all-reduce replaced by the exact mean: the
    weights after every round. In lockstep each peer's round gradient is its full gradient at the round's weights."""
    from swarm_opt.compression.sparse import SparseFeedback

    problems = [lsq_problem(r) for r in range(PEERS)]
    w = torch.zeros(LSQ_DIM, dtype=torch.float64)
    feedback = [SparseFeedback([w], TOPK_FRACTION) for _ in problems]
    trajectory = []
    for epoch in range(1, TOPK_EPOCHS + 1):
        sent = []
        for (a, b), peer in zip(problems, feedback):
            buffers = [a.T @ (a @ w - b)]
            peer.select(buffers, float(BATCH * STEPS), epoch)
            sent.append(buffers[0])
        w = w - LR * sum(sent) / PEERS
        for peer in feedback:
            peer.commit(epoch, averaged=True)
        trajectory.append(w)
    return trajectory


@pytest.mark.extended  # CI budget: TopK's bounds, identical results and error feedback are conformance tests
def test_topk_swarm_members_end_identical_and_follow_the_error_feedback_maths(swarm):
    """Three peers with TopK(0.2): every round's update has at most one value per peer, every member ends every
    round with the same weights, bit for bit, and those are TopK's in-process trajectory (float32 on the wire)."""
    for rank in range(PEERS):
        swarm.start(rank, strategy="grad", compression="TopK", compression_args={"fraction": TOPK_FRACTION},
                    expect_peers=PEERS, **dict(LOCKSTEP, epochs=TOPK_EPOCHS))
    swarm.wait(timeout=240)
    results = [swarm.result(r) for r in range(PEERS)]
    by_epoch = [{rnd["epoch"]: rnd["w"] for rnd in r["rounds"]} for r in results]
    previous = torch.zeros(LSQ_DIM, dtype=torch.float64)
    for epoch in range(1, TOPK_EPOCHS + 1):
        values = [weights[epoch] for weights in by_epoch if epoch in weights]
        assert values and all(torch.equal(values[0], v) for v in values), f"peers differ after round {epoch}"
        assert int((values[0] != previous).sum()) <= PEERS, f"round {epoch} applied more than 3 values"
        previous = values[0]
    assert all(torch.equal(results[0]["w"], r["w"]) for r in results)
    reference = topk_reference()
    optimum = lsq_optimum(range(PEERS)).reshape(-1)
    assert float((reference[-1] - optimum).norm()) < 0.8 * float(optimum.norm())  # it trains, sparsely
    if all(rnd["group_size"] == PEERS for r in results for rnd in r["rounds"]):  # no catch-up dropped a residual
        torch.testing.assert_close(results[0]["w"], reference[-1], rtol=1e-5, atol=1e-6)
    else:
        print("a round was not complete: the comparison with the in-process trajectory is skipped",
              swarm.round_events())
