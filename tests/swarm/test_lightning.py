"""SwarmCallback in real loopback swarms: three Lightning peers, each a Trainer in its own process
(``tests/swarm/lightning_peer.py``, launched and reaped by ``conftest.py``'s ``Swarm``)."""

from __future__ import annotations

import shutil
import time

import pytest
import torch

pytest.importorskip("lightning")

from swarm_opt.simulation import average_in_process  # noqa: E402
from swarm_opt.strategies import GradientAveraging, Scaffold  # noqa: E402
from tests.swarm.conftest import PEER_SCRIPT, Swarm, assert_quiet, assert_same_params_at_each_epoch  # noqa: E402
from tests.swarm.peer import make_data, make_model  # noqa: E402
from tests.swarm.test_strategies import _check_lockstep, _simulate  # noqa: E402

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

SCRIPT = PEER_SCRIPT.with_name("lightning_peer.py")
PEERS = 3
#: rounds start once every peer reported its steps (no extrapolation); matchmaking long enough for all to join
LOCKSTEP = dict(steps_per_round=4, max_extrapolation=0.0, matchmaking_time=2.0, averaging_timeout=20.0)


def run(swarm: Swarm, timeout: float = 150, **config) -> list:
    for rank in range(PEERS):
        swarm.start(rank, script=SCRIPT, expect_peers=PEERS, **config)
    swarm.wait(timeout=timeout)
    return [swarm.result(r) for r in range(PEERS)]


@pytest.mark.parametrize("module", ["boring", pytest.param("demo", marks=pytest.mark.extended)])
def test_lightning_demo_modules_train_unchanged_and_peers_agree(swarm, module):
    """BoringModel (its own data, SGD + StepLR) and DemoModel (Adam) as Lightning ships them: every peer holds the
    same parameters at every global epoch, the scheduler stepped once per global epoch, metrics were logged."""
    epochs = 4
    results = run(swarm, module=module, batch_size=8, target_batch_size=48, epochs=epochs, limit_val_batches=2)
    assert_same_params_at_each_epoch(results, epochs)
    assert all(len(r["params"]) >= 2 for r in results)  # each peer saw several epochs, not only the last one
    for r in results:
        assert r["logged"]["swarm/epoch"] >= epochs - 1 and r["logged"]["swarm/peers"] >= 1
        if module == "boring":  # StepLR(step_size=1, gamma=0.1), stepped on the global epoch
            assert r["lr"] == pytest.approx(0.1 * 0.1 ** epochs)
    assert_quiet(swarm)


@pytest.mark.extended
@pytest.mark.parametrize("strategy, cls", [("grad", GradientAveraging), ("scaffold", Scaffold)])
def test_a_lightning_swarm_computes_what_the_plain_loop_computes(swarm, strategy, cls):
    """Lockstep (4 optimizer steps per peer per round) on the heterogeneous least-squares problems of the plain
    swarm tests: the Lightning peers end with the parameters of the plain training loop of the same strategy code
    (``test_strategies._simulate``, which the plain-loop swarms are tested against)."""
    epochs = 4
    results = run(swarm, module="lsq", strategy=strategy, batch_size=16, target_batch_size=PEERS * 16 * 4,
                  epochs=epochs, **LOCKSTEP)
    history = _check_lockstep(results, epochs)
    expected = _simulate(cls, range(PEERS), rounds=epochs, steps=4, history=history)
    assert expected.norm() > 0.5  # it trained
    for r in results:
        torch.testing.assert_close(r["w"], expected, atol=1e-6, rtol=0)  # hivemind's reducers sum in float32
    if strategy == "scaffold":
        assert all(r["rounds"][-1]["d"].abs().max() > 1e-3 for r in results)  # the controls are in use


def plain_loop_mlp(rounds: int, steps: int, batch_size: int, clip: float, history: dict) -> list:
    """What the lockstep ``mlp`` peers of ``lightning_peer.py`` compute, as a plain loop with gradient averaging in
    one process: per step ``batch_size`` consecutive samples of the peer's data, ``local_step``; per round one
    in-process average (``history``: the rounds where some peers caught up by downloading), whose mean gradient the
    inner step clips to norm ``clip`` (Lightning's ``gradient_clip_val``, which the swarm optimizer applies to the
    global batch's gradient, as one Trainer clips its accumulated batch)."""
    peers = []
    for rank in range(PEERS):
        model = make_model(torch.float64)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        inner.register_step_pre_hook(_clipping(list(model.parameters()), clip))
        strategy = GradientAveraging()
        strategy.bind(list(model.parameters()), inner)
        x, y = make_data()
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1000 + rank))
        peers.append((model, inner, strategy, x[order].to(torch.float64), y[order]))
    for epoch in range(1, rounds + 1):
        for step in range(steps):
            for model, inner, strategy, x, y in peers:
                lo = ((epoch - 1) * steps + step) * batch_size
                inner.zero_grad()
                torch.nn.functional.cross_entropy(model(x[lo:lo + batch_size]), y[lo:lo + batch_size]).backward()
                strategy.local_step(batch_size)
        members, downloaders = history.get(epoch, (list(range(PEERS)), []))
        average_in_process([s for _, _, s, _, _ in peers], groups=[members])
        donor = next(m for m in members if m not in downloaders)
        for rank in downloaders:
            peers[rank][0].load_state_dict(peers[donor][0].state_dict())
            peers[rank][1].load_state_dict(peers[donor][1].state_dict())
            peers[rank][2].reset()
    return [p.detach() for p in peers[0][0].parameters()]


def _clipping(params: list, clip: float):
    """A step pre-hook that clips ``params``' gradients to norm ``clip`` before each step, as one process would."""
    def hook(optimizer, args, kwargs) -> None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    return hook


@pytest.mark.extended
def test_accumulating_four_batches_of_8_equals_the_plain_loop_with_batches_of_32(swarm):
    """One optimizer step over 4 micro-batches of 8 counts 32 samples and averages their gradient: in lockstep,
    with gradient clipping on (Lightning's ``gradient_clip_val``, which clips the global batch's mean gradient), the
    Lightning swarm ends with the parameters of the plain loop with batches of 32."""
    results = run(swarm, module="mlp", float64=True, batch_size=8, accumulate=4, target_batch_size=PEERS * 32 * 4,
                  epochs=3, gradient_clip_val=0.3, **LOCKSTEP)
    history = _check_lockstep(results, 3)
    committed = [rnd for r in results for rnd in r["rounds"] if not rnd["caught_up"]]
    assert committed and all(rnd["samples"] == 4 * 32 for rnd in committed)  # 4 optimizer steps of 32 samples
    expected = plain_loop_mlp(rounds=3, steps=4, batch_size=32, clip=0.3, history=history)
    for r in results:
        for got, want in zip(r["final"], expected):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)  # hivemind's reducers sum in float32
    unclipped = plain_loop_mlp(rounds=3, steps=4, batch_size=32, clip=float("inf"), history=history)
    assert max((a - b).abs().max() for a, b in zip(unclipped, expected)) > 1e-3  # clipping was in effect


@pytest.mark.extended
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_skips_an_overflowing_step_and_keeps_the_swarm_finite(swarm, precision):
    """Peer 0's 5th step has an infinite loss. With 16-mixed, Lightning's GradScaler skips the step (step() is never
    called, the scale backs off); with bf16-mixed swarm_opt skips it. Either way it never reaches the swarm: every
    peer stays finite and identical at every epoch. (On CPU Lightning replaces precision='16-mixed' by bf16 with a
    warning, so the test passes the fp16 MixedPrecision plugin itself.)"""
    epochs = 3
    results = run(swarm, module="mlp", precision=precision, batch_size=16, target_batch_size=192, epochs=epochs,
                  step_sleep=0.01, overflow_at_step={"0": 5})
    assert_same_params_at_each_epoch(results, epochs)
    if precision == "16-mixed":
        assert results[0]["scale"] < 65536.0  # the scaler found the overflow and backed off
    assert_quiet(swarm)


@pytest.mark.extended
@pytest.mark.timeout(420)  # four Lightning imports: a minute or more each on a loaded machine
def test_a_killed_lightning_peer_resumes_from_its_checkpoint_and_catches_up(swarm, tmp_path):
    """Peer 2 saves a Lightning checkpoint (trainer.save_checkpoint) at every global epoch; it is SIGKILLed
    mid-run and restarted with ckpt_path=: it resumes, catches up with the swarm, trains two more rounds with the
    others (the run goes on until then) and holds everyone's parameters at every epoch. The survivors never
    stall."""
    until = str(tmp_path / "resumed_trained")
    # the survivors train on until the replacement has trained with them: under load its start took 2 minutes, and
    # with the peers' default cap of 120 s they had left before it joined
    common = dict(script=SCRIPT, module="mlp", batch_size=16, target_batch_size=192, epochs=6, step_sleep=0.02,
                  checkpoint=True, until_file=until, max_seconds=360)
    for rank in range(PEERS):
        swarm.start(rank, expect_peers=PEERS, **common)
    deadline = time.monotonic() + 150
    while "epoch 1:" not in swarm.log(2) and time.monotonic() < deadline:
        time.sleep(0.1)
    resume = tmp_path / "resume.ckpt"  # its replacement imports while they train, then waits for this checkpoint
    swarm.start(3, expect_peers=PEERS - 1, resume=str(resume), signal_after_rounds=2, **common)
    deadline = time.monotonic() + 150
    while not ("epoch 3:" in swarm.log(2) and (tmp_path / "peer3.pt.ready").exists()) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "peer3.pt.ready").exists(), "the replacement did not finish its imports within 150 s"
    assert (tmp_path / "peer2.pt.ckpt").exists(), swarm.log(2)
    swarm.kill(2)
    killed_at = time.time()
    shutil.copy(tmp_path / "peer2.pt.ckpt", resume)
    swarm.wait(timeout=150)
    survivors = [swarm.result(r) for r in (0, 1)]
    resumed = swarm.result(3)
    assert "Restoring states from the checkpoint" in swarm.log(3)
    assert resumed["rounds"][0]["epoch"] >= 3  # it went on from its checkpoint's epoch or later, not from scratch
    assert sum(not rnd["caught_up"] and rnd["group_size"] == PEERS for rnd in resumed["rounds"]) >= 2
    assert_same_params_at_each_epoch(survivors + [resumed], 6)
    for r in survivors:  # never stalled: no gap between two of their epochs longer than a few rounds (they train on
        # at least until the resumed peer's two rounds with them, which follow the kill at once when it caught up as
        # the checkpoint loaded)
        times = [killed_at] + [rnd["time"] for rnd in r["rounds"] if rnd["time"] > killed_at]
        assert len(times) >= 3 and max(b - a for a, b in zip(times, times[1:])) < 20, r["rounds"]


@pytest.mark.extended
@pytest.mark.timeout(560)  # Lightning's ddp starts its second rank after the first one's imports
def test_a_lightning_ddp_machine_of_two_ranks_is_one_peer(swarm, tmp_path):
    """``Trainer(strategy="ddp", devices=2, accelerator="cpu")`` with an unchanged module: its two ranks are one
    peer (the single-device peer beside it sees two peers, never three), hold the same parameters at every global
    epoch as that peer, and train."""
    epochs = 4
    common = dict(script=SCRIPT, module="mlp", batch_size=8, target_batch_size=96, epochs=epochs, expect_peers=2,
                  step_sleep=0.01, max_seconds=450, expect_wait=240)  # the ddp machine starts slowly under load
    swarm.start(0, **common)
    swarm.start(1, devices=2, lightning_strategy="ddp", **common)
    swarm.wait(timeout=400)
    other, machine = swarm.result(0), swarm.result(1)
    follower = torch.load(tmp_path / "peer1.pt.rank1")
    assert_same_params_at_each_epoch([machine, follower, other], epochs)
    assert len(follower["params"]) >= 2  # the second rank mirrored several epochs, not only the last one
    together = [r for r in other["rounds"] if not r["caught_up"]]
    assert together and {r["num_peers"] for r in together} == {2}, other["rounds"]
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(machine["final"], make_model().parameters()))
    assert_quiet(swarm)
