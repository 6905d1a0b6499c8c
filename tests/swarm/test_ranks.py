"""A machine of several data-parallel ranks is one peer (``swarm_opt.ranks``): real swarms on loopback, each rank a
process of its own, the ranks of a machine joined by gloo."""

from __future__ import annotations

import re
import socket
import subprocess
import time

import pytest
import torch

import swarm_opt
from swarm_opt import testing
from swarm_opt.strategies import REGISTRY
from tests.swarm.conftest import OLDER_CHECKPOINT, assert_quiet
from tests.swarm.test_grad_averaging import assert_one_process

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_machine(swarm, first: int, batch_sizes, **config) -> None:
    """Start one peer of ``len(batch_sizes)`` ranks (swarm process ids ``first``, ``first + 1``, ...), rank r taking
    batches of ``batch_sizes[r]``."""
    port, total = free_port(), sum(batch_sizes)
    for r, batch_size in enumerate(batch_sizes):
        swarm.start(first + r, batch_size=batch_size, machine_batch_size=total,
                    local=dict(rank=r, size=len(batch_sizes), port=port), **config)


@pytest.mark.parametrize("inner", ["sgd", pytest.param("adamw", marks=pytest.mark.extended)])
def test_a_two_rank_peer_and_a_one_rank_peer_equal_one_process_on_the_union_of_batches(swarm, inner):
    """Ranks of 8 and 12 samples on one machine and a peer of 20 end with the parameters of one process on the
    union of every epoch's batches, all three processes identical; the machine publishes one progress record."""
    results = _machine_beside_a_peer(swarm, inner, [8, 12])
    # one record per machine: every peer saw two peers of the swarm, never three
    peers_seen = {rep["num_peers"] for r in (results[0], results[2]) for rep in r["reports"] if not rep["caught_up"]}
    assert peers_seen == {2}, peers_seen
    assert_one_process(results, inner, _EPOCHS)
    assert_quiet(swarm)


_EPOCHS = 4


def _machine_beside_a_peer(swarm, inner: str, rank_batches: list, **machine) -> list:
    """A machine of ranks with ``rank_batches`` and a one-rank peer of 20 train ``_EPOCHS`` epochs; their results,
    checked: every process at the last epoch, the machine's ranks identical."""
    common = dict(target_batch_size=240, inner=inner, epochs=_EPOCHS, expect_peers=2, step_sleep=0.03)
    start_machine(swarm, 0, rank_batches, **machine, **common)
    swarm.start(2, batch_size=20, **common)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    for r in results:
        assert r["epoch"] == _EPOCHS
    for p, q in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(p, q), "the ranks of the machine disagree"
    return results


@pytest.mark.extended
@pytest.mark.parametrize("inner", ["sgd", "adamw"])
def test_a_two_rank_fsdp2_peer_and_a_one_rank_peer_equal_one_process_on_the_union_of_batches(swarm, inner):
    """The machine's model is sharded over its two ranks (FSDP2 ``fully_shard``: each rank holds half of every
    layer); rank 0 trains one full copy with the swarm and every rank takes its slice. With a plain peer beside it,
    the three processes end with the parameters of one process on the union of every epoch's batches (FSDP2 weighs
    its ranks equally: equal batches)."""
    results = _machine_beside_a_peer(swarm, inner, [10, 10], fsdp=True)
    assert_one_process(results, inner, _EPOCHS)
    assert_quiet(swarm)


#: lockstep local updates (``peer.run_lsq``): every process completes exactly this many local steps per round
LOCKSTEP = dict(task="lsq", batch_size=16, steps_per_round=10, target_batch_size=(32 + 16) * 10, epochs=4,
                step_sleep=0.005, matchmaking_time=5.0, averaging_timeout=20.0, max_extrapolation=0.0,
                expect_peers=2)


def simulate(strategy: str, rounds: int, steps: int = 10) -> torch.Tensor:
    """In-process: a peer stepping on the mean gradient of least-squares problems 0 and 1 (the machine's two
    ranks, 16 samples each) and a peer on problem 2, averaged every ``steps`` local steps, weighted by samples."""
    from swarm_opt.simulation import average_in_process
    from tests.swarm.peer import lsq_problem, make_strategy

    peers = []
    for problems in ([0, 1], [2]):
        w = torch.nn.Parameter(torch.zeros(1, 5, dtype=torch.float64))
        inner = torch.optim.SGD([w], lr=0.05)
        s = make_strategy(strategy)
        s.bind([w], inner)
        peers.append((w, inner, s, [lsq_problem(p) for p in problems]))
    for _ in range(rounds):
        for w, inner, s, problems in peers:
            for _ in range(steps):
                inner.zero_grad()
                grads = []
                for a, b in problems:
                    w.grad = None
                    (0.5 * (a @ w[0] - b).pow(2).sum()).backward()
                    grads.append(w.grad.clone())
                w.grad = sum(grads) / len(grads)
                s.local_step(16 * len(problems))
        average_in_process([s for _, _, s, _ in peers])
    return peers[0][0].detach()[0]


#: every strategy a run can name; ``local`` runs in the default suite, the others with the extended scenarios
#: (``grad``'s equivalence with one process on MLP batches is the default suite's first test above)
STRATEGIES = [row.name for row in REGISTRY]


@pytest.mark.parametrize("strategy", [s if s == "local" else pytest.param(s, marks=pytest.mark.extended)
                                      for s in STRATEGIES])
def test_every_strategy_with_a_two_rank_peer_equals_one_peer_stepping_on_both_ranks_gradients(swarm, strategy):
    """Every registered strategy, in lockstep (each process completes the same local steps per round): the
    machine's ranks step on their combined gradient and leave every epoch identical, parameters and strategy
    state (SCAFFOLD's controls) alike (each repeats the strategy's local step; a round's state reaches the
    follower from rank 0), and the swarm follows the in-process simulation in which the machine is one peer. No
    strategy has a line of its own in ``swarm_opt.ranks``."""
    config = {k: v for k, v in LOCKSTEP.items() if k != "batch_size"}
    start_machine(swarm, 0, [16, 16], strategy=strategy, **config)
    swarm.start(2, strategy=strategy, batch_size=16, **config)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    assert all(r["epoch"] == LOCKSTEP["epochs"] for r in results)
    rank0, rank1 = results[0]["rounds"], results[1]["rounds"]
    assert [r["epoch"] for r in rank0] == [r["epoch"] for r in rank1] == list(range(1, LOCKSTEP["epochs"] + 1))
    for a, b in zip(rank0, rank1):
        assert torch.equal(a["w"], b["w"]), f"the ranks of the machine disagree after epoch {a['epoch']}"
        assert (a["d"] is None) == (b["d"] is None) and (a["d"] is None or torch.equal(a["d"], b["d"])), \
            f"the ranks' strategy states disagree after epoch {a['epoch']}"
    for r in (results[0], results[2]):
        assert all(not rnd["caught_up"] and rnd["group_size"] == 2 for rnd in r["rounds"]), r["rounds"]
    expected = simulate(strategy, LOCKSTEP["epochs"])
    for r in results:
        torch.testing.assert_close(r["w"], expected, atol=1e-5, rtol=0)
    assert_quiet(swarm)


@pytest.mark.extended
@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "fsdp2"])
def test_a_machine_writes_each_checkpoint_once_and_every_rank_resumes_from_it(swarm, tmp_path, sharded):
    """Both ranks of a DiLoCo machine build a Checkpointer on one directory: rank 0 writes (no lock clash), and a
    restarted machine resumes on both ranks from the same state and trains on identically. Sharded over the ranks
    (FSDP2, a 2 x 5 weight: one row each), the checkpoint holds the full model, which every rank restores into its
    shard."""
    ckpt = tmp_path / "ckpt"
    config = {k: v for k, v in LOCKSTEP.items() if k not in ("batch_size", "expect_peers")}
    if sharded:
        config.update(fsdp=True, lsq_outputs=2)
    config["target_batch_size"] = 32 * 10  # the machine alone
    start_machine(swarm, 0, [16, 16], strategy="diloco", checkpoint=str(ckpt), **dict(config, epochs=2))
    swarm.wait(timeout=120)
    first = [swarm.result(r) for r in range(2)]
    assert [p.name for p in sorted(ckpt.glob("epoch-*.pt"))] == [f"epoch-0000000{e}.pt" for e in range(3)]
    assert torch.equal(first[0]["w"], first[1]["w"])
    swarm.kill_all()

    again = type(swarm)(tmp_path / "again")
    (tmp_path / "again").mkdir()
    try:
        start_machine(again, 0, [16, 16], strategy="diloco", checkpoint=str(ckpt), **dict(config, epochs=3))
        again.wait(timeout=120)
        resumed = [again.result(r) for r in range(2)]
    finally:
        again.kill_all()
    for r in resumed:
        assert r["restored"]["epoch"] == 2 and torch.equal(r["restored"]["w"], first[0]["w"])
        assert r["epoch"] == 3
    assert torch.equal(resumed[0]["w"], resumed[1]["w"])
    assert not torch.equal(resumed[0]["w"], first[0]["w"])  # it trained on from there
    assert (ckpt / "epoch-00000003.pt").exists()


@pytest.mark.extended
@pytest.mark.timeout(420)
def test_a_machine_resuming_an_older_checkpoint_takes_the_swarms_state_on_every_rank_as_it_loads(swarm, tmp_path):
    """A 2-rank machine beside two one-process peers checkpoints every epoch, is killed after epoch 2 and restarts
    from that checkpoint while the others trained on: rank 0 downloads the swarm's newer state as the checkpoint
    loads (``Optimizer.load_state_dict``) and rank 1 takes it from rank 0, so both ranks step first at the swarm's
    state, not at the checkpoint's; then the four processes train on to one model."""
    ckpt, epochs = tmp_path / "ckpt", 25
    common = dict(task="lsq", target_batch_size=64, inner="sgd", step_sleep=0.2, averaging_timeout=15.0,
                  max_seconds=180, epochs=epochs)
    swarm.start(0, batch_size=16, expect_peers=3, **common)
    swarm.start(1, batch_size=16, expect_peers=3, **common)
    start_machine(swarm, 2, [8, 8], checkpoint=str(ckpt), expect_peers=3, **common)
    _wait_for(lambda: (ckpt / "epoch-00000002.pt").exists(), 90, lambda: swarm.log(2))
    swarm.kill(2)
    swarm.kill(3)
    _wait_for(lambda: _logged_epoch(swarm.log(0)) >= 5, 90, lambda: swarm.log(0))
    start_machine(swarm, 4, [8, 8], checkpoint=str(ckpt), **common)
    swarm.wait(timeout=240)
    results = {r: swarm.result(r) for r in (0, 1, 4, 5)}
    restored = [results[r]["restored"] for r in (4, 5)]
    assert restored[0]["epoch"] == restored[1]["epoch"] > 2, restored  # the swarm's epoch, not the checkpoint's
    assert torch.equal(restored[0]["w"], restored[1]["w"]), restored
    # the state it downloaded as it joined, put back over the checkpoint; or, without one, a download as it loads
    assert re.search(OLDER_CHECKPOINT, swarm.log(4)), swarm.log(4)
    for r in (0, 1, 4, 5):
        assert results[r]["epoch"] == epochs
        assert torch.allclose(results[r]["w"], results[0]["w"], rtol=0, atol=1e-6), {k: v["w"] for k, v in
                                                                                        results.items()}
    for r in (4, 5):
        assert "Traceback" not in swarm.log(r) and " WARNING " not in swarm.log(r), swarm.log(r)


def _wait_for(condition, timeout: float, log) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, log()
        time.sleep(0.1)


def _logged_epoch(log: str) -> int:
    return max((int(e) for e in re.findall(r"epoch (\d+): averaged", log)), default=0)


@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.extended)])
def test_a_killed_rank_takes_its_machine_out_and_the_other_peer_trains_on(swarm, victim):
    """SIGKILL one rank of the 2-rank peer (1: a follower, 0: the rank that speaks for the machine) after epoch 2:
    the machine's other rank stops within seconds with one LocalGroupError line (rank 0 first withdraws the
    machine's record), and the 1-rank peer goes on to its last epoch."""
    common = dict(target_batch_size=240, inner="sgd", expect_peers=2, step_sleep=0.03, averaging_timeout=15.0)
    start_machine(swarm, 0, [8, 12], epochs=100, **common)
    swarm.start(2, batch_size=20, epochs=8, **common)
    deadline = time.monotonic() + 90
    while "epoch 2:" not in swarm.log(2) and time.monotonic() < deadline:
        time.sleep(0.02)
    survivor = swarm.procs[1 - victim]
    swarm.kill(victim)
    killed = time.monotonic()
    try:
        survivor.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank {1 - victim} of the machine still runs 30 s after rank {victim} died:\n"
                    f"{swarm.log(1 - victim)}")
    assert time.monotonic() - killed < 30
    log = swarm.log(1 - victim)
    assert survivor.returncode == 3, log
    assert "Traceback" not in log and "LocalGroupError: local rank" in log and "left the swarm" in log, log
    testing.kill([swarm.procs.pop(1 - victim)])  # its session: its DHT process and p2pd may still linger
    swarm.wait(timeout=150)
    lone = swarm.result(2)
    assert lone["epoch"] == 8
    assert lone["reports"][-1]["num_peers"] == 1, lone["reports"][-1]  # the machine's record is gone


@pytest.mark.extended
def test_a_follower_waits_for_rank_0s_round_as_long_as_its_adaptive_deadline_and_no_longer(swarm):
    """Adaptive deadlines on, rounds that take well under a second: once rank 0's averaging deadline followed them
    below the user's 60 s, it announces each round's deadline to the follower. Rank 0 then hangs inside a round:
    the follower leaves with one LocalGroupError line within that deadline plus its own allowance, minutes before
    the bound the user's timeouts alone give (what followers waited before)."""
    local_timeout, averaging_timeout, hang_at = 10.0, 60.0, 9
    common = dict(target_batch_size=240, inner="sgd", expect_peers=2, step_sleep=0.03, adaptive_deadlines=True,
                  averaging_timeout=averaging_timeout, local_timeout=local_timeout)
    port = free_port()
    swarm.start(0, batch_size=8, machine_batch_size=20, local=dict(rank=0, size=2, port=port), epochs=100,
                hang_in_round=hang_at, **common)
    swarm.start(1, batch_size=12, machine_batch_size=20, local=dict(rank=1, size=2, port=port), epochs=100, **common)
    swarm.start(2, batch_size=20, epochs=100, **common)
    hung = swarm.tmp / "peer0.pt.hung"
    deadline = time.monotonic() + 150
    while not hung.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hung.exists(), swarm.log(0)
    hung_at = time.monotonic()
    timeouts = swarm_opt.Timeouts(matchmaking_time=1.0, averaging_timeout=averaging_timeout)
    static = local_timeout + timeouts.matchmaking_time + 4 * averaging_timeout + timeouts.state_download_timeout
    follower = swarm.procs[1]
    try:
        follower.wait(static / 2)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the follower still waits {static / 2:.0f} s after rank 0 hung:\n{swarm.log(1)}")
    waited = time.monotonic() - hung_at
    log = swarm.log(1)
    assert follower.returncode == 3 and "Traceback" not in log, log
    announced = re.search(r"waiting for rank 0's step \(its deadline (\d+) s\) failed \(no answer within (\d+) s\)",
                          log)
    assert announced is not None, log
    round_deadline, allowed = int(announced.group(1)), int(announced.group(2))
    # the round's deadline followed the measured rounds: without adaptation it is 2 x 60 + 1 s
    assert round_deadline < 2 * averaging_timeout + timeouts.matchmaking_time - 1, log
    assert allowed == pytest.approx(round_deadline + local_timeout + 15, abs=1)
    assert waited < allowed + 10, (waited, allowed)
    swarm.kill_all()


@pytest.mark.parametrize("differ, says", [
    (dict(run_id="other_run"), "disagree on the run_id ('test_run' on rank 0, 'other_run' on rank 1)"),
    (dict(dtype="bfloat16"), "disagree on the model, strategy or recipe (model_schema)"),
])
def test_ranks_that_disagree_fail_at_once_with_one_line_on_every_rank(swarm, differ, says):
    port = free_port()
    common = dict(target_batch_size=240, inner="sgd", epochs=2, batch_size=8)
    swarm.start(0, local=dict(rank=0, size=2, port=port), **common)
    swarm.start(1, local=dict(rank=1, size=2, port=port), **dict(common, **differ))
    for rank, proc in list(swarm.procs.items()):
        proc.wait(150)  # start-up (imports, rank 0's DHT); the check itself answers at once, not after a timeout:
        log = swarm.log(rank)
        assert proc.returncode == 3, log
        errors = [line for line in log.splitlines() if line.startswith("ConfigError:")]
        assert len(errors) == 1 and says in errors[0] and "Traceback" not in log, log  # (a timeout says so)
