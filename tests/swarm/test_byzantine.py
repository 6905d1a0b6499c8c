"""Hostile and broken peers in real loopback swarms: 4 peers, one of them sending absurd gradients or none at all."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from tests.swarm.peer import make_data, make_model

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

HONEST = (0, 1, 2)
ATTACKER = 3


def loss_of(params: list) -> float:
    x, y = make_data()
    model = make_model()
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
        return float(torch.nn.functional.cross_entropy(model(x), y))


def drift(params: list) -> float:
    """The mean change of every parameter value since the start: near 0 for honest training, pushed down by a
    reducer that adds a positive offset to the averaged gradients."""
    start = [p.detach() for p in make_model().parameters()]
    return float(sum((p - p0).sum() for p, p0 in zip(params, start)) / sum(p0.numel() for p0 in start))


def run(swarm, epochs: int, attack: Optional[dict], lie_in_reduce_rank: Optional[int] = None, inner: str = "sgd",
        **config) -> list:
    for rank in range(4):
        swarm.start(rank, batch_size=16, target_batch_size=64, inner=inner, epochs=epochs, expect_peers=4,
                    step_sleep=0.02, max_seconds=90, linger=5.0, attack=attack if rank == ATTACKER else None,
                    lie_in_reduce=1.0 if rank == lie_in_reduce_rank else None, **config)
    swarm.wait(timeout=200)
    return [swarm.result(rank) for rank in HONEST]


@pytest.mark.extended
@pytest.mark.parametrize("aggregation, args, strategy", [("CenteredClip", {}, "grad"),
                                                         ("TrimmedMean", {"fraction": 0.25}, "grad"),
                                                         ("CenteredClip", {}, "local"),
                                                         ("CenteredClip", {}, "grad_momentum"),
                                                         ("reputation:centered-clip", {}, "local")])
def test_robust_aggregation_contains_a_sign_flipping_attacker(swarm, aggregation, args, strategy):
    """An attacker stepping on its gradients x(-1000) (every member receives the robust estimate, the attacker too):
    the honest peers learn as if it was not there, where the norm-bounded mean makes them climb the loss. With local
    updates the attacker's parameters are what is absurd; with WorkerMomentum, its momentum. ``Reputation`` over
    parameter averaging: the same, through its scores and vote."""
    epochs = 8
    results = run(swarm, epochs, {"scale": -1000.0}, aggregation=aggregation, aggregation_args=args,
                  strategy=strategy, **({"inner": "sgd_plain"} if strategy == "grad_momentum" else {}))
    initial = loss_of([p.detach() for p in make_model().parameters()])
    for r in results:
        assert r["epoch"] == epochs, swarm.round_events()
        assert all(bool(torch.isfinite(p).all()) for p in r["params"])
        assert loss_of(r["params"]) < initial - 0.2, (loss_of(r["params"]), initial)
    # every member of the last round ends it with the same values (an honest peer late to it, as on a loaded machine,
    # keeps its local model under local updates: the strategy's rule, not the attacker's doing)
    members = [r for r in results if any(rep["epoch"] == epochs and not rep["caught_up"] for rep in r["reports"])]
    assert len(members) >= 2, swarm.round_events()
    for r in members[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], members[0]["params"]))


@pytest.mark.extended
def test_the_default_mean_bounds_an_absurd_attacker_but_lets_it_steer(swarm):
    """Gradients x(-10⁶) with the default ``Mean()``: its norm bound keeps the honest peers' values near their scale
    (the plain mean sends them towards overflow), but a sign-flipped gradient 10x an honest one outweighs the three
    honest ones: their loss goes up. Robust aggregation is what stops that (above)."""
    epochs = 8
    results = run(swarm, epochs, {"scale": -1e6})
    initial = loss_of([p.detach() for p in make_model().parameters()])
    for r in results:
        largest = max(float(p.abs().max()) for p in r["params"])
        assert largest < 100, largest  # the plain mean (max_norm_ratio=None) reaches 1e8
        assert loss_of(r["params"]) > initial, (loss_of(r["params"]), initial)


def test_a_peer_with_nan_gradients_does_not_hold_the_others_up(swarm):
    """A broken peer whose gradients are always NaN has its steps skipped (no samples): it must not join averaging
    groups it would never send to, where its groupmates waited for it and failed the round."""
    for rank in range(4):
        swarm.start(rank, batch_size=16, target_batch_size=64, inner="sgd", epochs=6, expect_peers=4,
                    step_sleep=0.02, max_seconds=60, linger=30.0, attack={"nan": True} if rank == ATTACKER else None)
    swarm.wait(timeout=200)
    attacker = swarm.result(ATTACKER)["peer_id"]
    assert all(rep["caught_up"] for rep in swarm.result(ATTACKER)["reports"])  # it follows, it never averages
    for rank in HONEST:
        assert swarm.result(rank)["epoch"] == 6, swarm.round_events()
        # the broken peer's mark: a group it joined waited for it and failed (a round that names an honest member
        # comes from load: a peer starved of CPU for seconds)
        failures = [line for line in swarm.log(rank).splitlines() if "did not start sending" in line]
        assert not [line for line in failures if attacker in line], "\n".join(failures)


@pytest.mark.extended
def test_peers_with_different_aggregations_refuse_to_average_and_say_why(swarm):
    """Each member reduces its share with its own aggregation: a group that mixes them would be robust on some
    parts only. Its rounds are discarded, and each peer says once what to fix."""
    for rank, aggregation in enumerate(["CenteredClip", "Mean"]):
        # for a fixed time, not a number of epochs: a peer that started long before the other trains alone meanwhile
        swarm.start(rank, batch_size=16, target_batch_size=64, inner="sgd", epochs=10_000, expect_peers=2,
                    step_sleep=0.02, max_seconds=20, linger=1.0, aggregation=aggregation)
    swarm.wait(timeout=120)
    for rank in range(2):
        reports = swarm.result(rank)["reports"]
        assert all(r["group_size"] < 2 for r in reports), reports  # (a peer may train alone before the other joins)
        errors = [line for line in swarm.log(rank).splitlines() if "must pass the same aggregation=" in line]
        assert len(errors) == 1, swarm.log(rank)


def test_audited_reducers_catch_a_lying_reducer_and_train_on_without_it(swarm):
    """A member whose reducer adds 1.0 to every mean it returns (the same wrong values to everyone: no digest
    shows it). With ``Audited()`` each part is reduced twice, the honest members see the two results differ, fail
    the round, and name the liar (it disagreed with both of its audit partners); from then on they form groups
    without it (3 of 4 is a majority) and learn. Without the audit the offset goes into every round (below). A round
    in which the liar reduces no part (hivemind deals whole parts: with this small model one member of four reduces
    none) is honest and may commit with it; the drift shows whether any lie got in (one round of it would)."""
    epochs = 4
    results = run(swarm, epochs, None, aggregation="Audited", lie_in_reduce_rank=ATTACKER)
    liar = swarm.result(ATTACKER)["peer_id"]
    initial = loss_of([p.detach() for p in make_model().parameters()])
    namers = 0
    for rank, r in zip(HONEST, results):
        assert r["epoch"] == epochs, swarm.round_events()
        assert loss_of(r["params"]) < initial - 0.1, (loss_of(r["params"]), initial)
        # honest: |drift| <= 3.3e-5 (4 runs); one lie on the smallest share (4 values) moves it by >= 0.1 * 4 / 676
        # = 6e-4 in its round and ~1.6e-3 with the momentum of the rounds after; without the audit: -0.28 (below)
        assert abs(drift(r["params"])) < 1e-3, drift(r["params"])
        # a peer names the liar once, when an audited round it took part in caught it; under load a peer whose
        # early rounds failed for other reasons may only have met groups that its groupmates already kept it out of
        named = [line for line in swarm.log(rank).splitlines() if "it lies (or is broken)" in line]
        assert len(named) <= 1 and all(liar in line for line in named), swarm.log(rank)
        namers += len(named)
    assert namers >= 1, [swarm.log(rank) for rank in HONEST]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"]))


@pytest.mark.extended
def test_a_lying_reducer_goes_unnoticed_without_the_audit(swarm):
    """The control: the same liar with the default ``Mean()``: rounds commit with it (under load a round may commit
    among 3 of 4 when one peer misses matchmaking, with or without the liar), and its offset in the honest peers'
    gradients drags all their parameters down."""
    epochs = 5
    results = run(swarm, epochs, None, lie_in_reduce_rank=ATTACKER)
    for r in results:
        assert r["epoch"] == epochs, swarm.round_events()
        assert sum(report["group_size"] == 4 for report in r["reports"]) >= 2, r["reports"]
        assert drift(r["params"]) < -0.1, drift(r["params"])


def test_reputation_leaves_out_a_sign_flipper_that_no_one_round_shows(swarm):
    """An attacker that sends its gradients sign-flipped at their honest size: CenteredClip keeps it (it lies as far
    from the honest copies as they from each other) and it halves every step. With ``Reputation`` each reducer
    remembers that its copies point against the others' results; after a few rounds the honest members name it in the
    gather, and, more than half of the group naming it, every reducer leaves its copies out. Audited on top (the
    command line's form): the reducers of a part must leave out the same members, or the audit would fail rounds."""
    epochs = 16  # it is left out from about its 5th round (3 to judge, 1 to vote); judged against results that
    # include its own copy, its cosine was +0.1 to +0.2 in groups of 4 and it was left out late or never (seen in CI)
    results = run(swarm, epochs, {"scale": -1.0}, aggregation="audited:reputation:centered-clip")
    attacker = swarm.result(ATTACKER)["peer_id"]
    initial = loss_of([p.detach() for p in make_model().parameters()])
    namers = 0
    for rank, r in zip(HONEST, results):
        assert r["epoch"] == epochs, swarm.round_events()
        assert loss_of(r["params"]) < initial - 0.2, (loss_of(r["params"]), initial)
        lines = [line for line in swarm.log(rank).splitlines() if "left out of this group's reduction" in line]
        assert len(lines) <= 1 and all(attacker in line for line in lines), swarm.log(rank)  # never an honest peer
        assert not [line for line in swarm.log(rank).splitlines() if "it lies (or is broken)" in line]
        namers += len(lines)
    assert namers >= 2, [swarm.log(rank) for rank in HONEST]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"]))


def test_a_newcomer_keeps_its_own_momentum_never_its_donors():
    """``WorkerMomentum``'s momentum is each peer's own, vouched for by no majority: a hostile donor serving a huge
    one would make the newcomer send its attack (seen: an honest peer that caught up from the attacker of the test
    above became a second attacker). A download leaves ours as it was, or none."""
    import hivemind

    import swarm_opt

    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    model = torch.nn.Linear(4, 3)
    opt = swarm_opt.Optimizer(dht=dht, run_id="own-momentum", target_batch_size=64, params=model.parameters(),
                              optimizer=lambda p: torch.optim.SGD(p, lr=1.0), matchmaking_time=1.0,
                              averaging_timeout=5.0, batch_size_per_step=8,
                              strategy=swarm_opt.GradientAveraging(momentum=swarm_opt.WorkerMomentum(0.9)))
    try:
        opt.strategy._momentum = [torch.full_like(p, -1e3) for p in model.parameters()]  # the donor's
        meta, tensors = opt._shareable_state()
        for ours in (None, [torch.full_like(p, 0.5) for p in model.parameters()]):
            opt.strategy._momentum = ours
            epoch = opt.local_epoch + 1
            assert opt._apply_downloaded_state(dict(meta, epoch=epoch), tensors, b"donor", min_epoch=epoch) == epoch
            if ours is None:
                assert opt.strategy._momentum is None
            else:
                assert all(bool((m == 0.5).all()) for m in opt.strategy._momentum)
    finally:
        opt.shutdown()
        dht.shutdown()
