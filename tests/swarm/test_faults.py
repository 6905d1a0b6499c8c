"""Peers SIGKILLed at precise moments: inside the all-reduce, and while serving state to a newcomer.

The killing happens from inside the victim (fault injection patched into hivemind's averager process by
``tests/swarm/peer.py``), so the moment is exact rather than a lucky race. Killing during matchmaking and while
computing is covered by ``test_grad_averaging.py``.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from swarm_opt.deadlines import MIN_AVERAGING_TIMEOUT
from tests.swarm.test_grad_averaging import _close, assert_quiet, possible_references

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

AVERAGING_TIMEOUT = 30.0  # waiting out a timeout for the dead peer would show as a gap of >= 10 s (next-chunk timeout)


def killed_peer_batches(journal: Path, rank: int) -> dict:
    """What a SIGKILLed peer committed to each epoch, from its journal; the batches of the round it died in may or
    may not have reached its groupmates, so they count as discarded (used once or not at all)."""
    committed, discarded, versions, pending = {}, {}, {}, []
    for line in journal.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the kill
            continue
        if "batch" in record:
            pending.append((record["batch"], record["version"]))
            continue
        if record["caught_up"]:
            discarded[record["epoch"]] = [b for b, _ in pending]
            versions[record["epoch"]] = [v for _, v in pending]
        else:
            committed[record["epoch"]] = [b for b, _ in pending]
        pending = []
    last = max(list(committed) + list(discarded) + [0])
    discarded[last + 1] = [b for b, _ in pending]
    versions[last + 1] = [v for _, v in pending]
    return dict(rank=rank, committed=committed, discarded=discarded, discarded_versions=versions, last_epoch=last)


def start_four(swarm, epochs: int, extra: dict) -> None:
    """Four peers of gradient averaging; ``extra[rank]`` adds options (fault injection) to one peer's config."""
    for rank in range(4):
        swarm.start(rank, batch_size=16, target_batch_size=256, inner="sgd", epochs=epochs, expect_peers=4,
                    step_sleep=0.03, averaging_timeout=AVERAGING_TIMEOUT, **extra.get(rank, {}))


def assert_no_stall(reports: list) -> None:
    times = [r["time"] for r in reports if not r["caught_up"]]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < 8.0, gaps


def test_a_peer_killed_inside_the_all_reduce_leaves_the_survivors_with_their_own_average(swarm):
    """The victim dies after sending its tensors, with its groupmates still exchanging parts with it. The survivors
    must not apply a partial average: they end with exactly one model, equal to one process applying SGD to the
    batches the survivors (and the victim, in the rounds it completed) committed; the victim's last batches may have
    reached nobody or everybody, never some peers only."""
    epochs = 6
    victim = 3
    start_four(swarm, epochs, {victim: dict(die_in_allreduce=True, hold_replies=True, arm_at_epoch=2, journal=True)})
    swarm.procs[victim].wait(120)
    assert swarm.procs[victim].returncode == -signal.SIGKILL, swarm.log(victim)
    swarm.procs.pop(victim)
    swarm.wait(timeout=150)
    survivors = [swarm.result(r) for r in range(3)]
    dead = killed_peer_batches(swarm.tmp / f"peer{victim}.pt.journal", victim)
    assert dead["last_epoch"] >= 2, dead  # it died in a round after epoch 2 (armed there), not before
    for r in survivors:
        assert r["epoch"] == epochs
        assert_quiet(swarm.log(r["rank"]))
        assert all(torch.isfinite(p).all() for p in r["params"])
        assert_no_stall(r["reports"])
        assert [rep for rep in r["reports"] if not rep["caught_up"]][-1]["group_size"] == 3
    # the survivors' logs say why each failed round failed, and the round with the victim failed for a member,
    # unless the victim reduced no share of it (hivemind's load balancing may give a loaded peer none): then its
    # parts had all come back, and everybody committed its last batches (the references below allow both)
    failures = re.findall(r"did not reach a majority of \d peers \(failed: (.*)\); keeping", swarm.round_events())
    assert all(failures), swarm.round_events()
    # one group commits each epoch (a majority of the 4); the victim was in it if it held more than the survivors
    # that committed the epoch (a survivor that started late may have caught up instead)
    members = [{rep["epoch"]: rep["group_size"] for rep in r["reports"] if not rep["caught_up"]} for r in survivors]
    sizes = {epoch: size for m in members for epoch, size in m.items()}
    last_with_victim = max((epoch for epoch, size in sizes.items() if size > sum(epoch in m for m in members)),
                           default=0)
    if last_with_victim <= dead["last_epoch"]:  # the victim's last round is not among the survivors' commits
        assert any(re.search(r"sender\(s\) failed|sent CANCELLED|did not start sending", f) for f in failures), \
            failures
    for r in survivors[1:]:
        assert _close(r["params"], survivors[0]["params"], 1e-6)
    references = list(possible_references(survivors + [dead], "sgd", epochs))
    assert any(_close(survivors[0]["params"], expected) for expected in references), \
        [max((a - b).abs().max().item() for a, b in zip(survivors[0]["params"], e)) for e in references]


def _reached(log: str, epoch: int) -> bool:
    """Whether a peer's log shows it at ``epoch`` or later: by a round it committed, or by catching up (a peer that
    started late may reach the swarm's epoch only by downloads while the others train on)."""
    committed = re.findall(r"INFO swarm_opt.optimizer: epoch (\d+):", log)
    loaded = re.findall(r"Loaded the swarm's state at epoch (\d+)", log)
    return any(int(e) >= epoch for e in committed + loaded)


def test_a_donor_killed_while_sending_its_state_does_not_stop_the_newcomer(swarm, tmp_path):
    """Every old peer is armed to die right after the first message of a state download (the first to be asked
    dies). The old peers wait at epoch 3 until the newcomer joined (a peer needs seconds to start on a loaded
    machine). The newcomer must fetch the state from another donor within its bounded retry, then train in step with
    the swarm."""
    token = tmp_path / "die_while_serving"
    token.touch()  # disarmed while it exists: the old peers' own catch-up downloads must not trigger it
    epochs = 8
    for rank in range(4):
        (swarm.tmp / f"peer{rank}.pt.hold").touch()
    start_four(swarm, epochs, {rank: dict(die_while_serving=str(token), hold_at_epoch=3) for rank in range(4)})
    deadline = time.monotonic() + 120
    while not all(_reached(swarm.log(rank), 3) for rank in range(4)):
        assert time.monotonic() < deadline, [swarm.log(rank)[-2000:] for rank in range(4)]
        time.sleep(0.1)
    token.unlink()  # armed
    swarm.start(4, batch_size=16, target_batch_size=256, inner="sgd", epochs=epochs, expect_peers=1, step_sleep=0.03,
                averaging_timeout=AVERAGING_TIMEOUT)
    deadline = time.monotonic() + 120
    while "Loaded the swarm's state" not in swarm.log(4):
        assert time.monotonic() < deadline, swarm.log(4)
        time.sleep(0.1)
    for rank in range(4):
        (swarm.tmp / f"peer{rank}.pt.hold").unlink()
    deadline = time.monotonic() + 15  # the newcomer may have its state from the next donor before the kill lands
    while not (dead := [rank for rank, proc in swarm.procs.items() if proc.poll() is not None]):
        assert time.monotonic() < deadline, "the first donor asked did not die"
        time.sleep(0.1)
    assert len(dead) == 1, "exactly the first donor asked dies"
    victim = dead[0]
    assert swarm.procs[victim].returncode == -signal.SIGKILL, swarm.log(victim)
    assert "Sending our state" in swarm.log(victim)
    swarm.procs.pop(victim)
    swarm.wait(timeout=150)
    live = [swarm.result(rank) for rank in swarm.procs]
    newcomer = swarm.result(4)
    assert newcomer["reports"][0]["caught_up"] and newcomer["reports"][0]["epoch"] == 3, newcomer["reports"]
    assert any(rep["group_size"] == 4 for rep in newcomer["reports"]), "the newcomer never averaged with the swarm"
    for r in live:
        assert r["epoch"] == epochs
        assert all(torch.isfinite(p).all() for p in r["params"])
        assert _close(r["params"], live[0]["params"], 1e-6)
        assert_quiet(swarm.log(r["rank"]))


@pytest.mark.extended  # CI budget; the donor cap that spreads newcomers is tests/swarm/test_newcomers.py
def test_newcomers_spread_their_state_downloads_over_several_donors(swarm):
    """Three donors at the same epoch; two newcomers download the state ten times each. hivemind's newcomers all
    hammered one donor (hivemind#169); ours draw among the donors of the highest epoch."""
    for rank in range(3):
        # the donors stay until the test ends (swarm.wait stops everyone): newcomers may take a minute to start
        swarm.start(rank, batch_size=16, target_batch_size=128, inner="sgd", epochs=2, expect_peers=3,
                    step_sleep=0.01, linger=240.0)
    deadline = time.monotonic() + 120
    while not all((swarm.tmp / f"peer{rank}.pt").exists() for rank in range(3)):
        assert time.monotonic() < deadline, [swarm.log(rank)[-2000:] for rank in range(3)]
        time.sleep(0.1)
    downloads = 10
    for rank in (3, 4):
        swarm.start(rank, batch_size=16, target_batch_size=128, inner="sgd", epochs=0, downloads=downloads)
    swarm.wait(timeout=150)
    served = {rank: len(re.findall("Sending our state", swarm.log(rank))) for rank in range(5)}
    assert sum(served.values()) >= 2 * downloads, served  # (plus any catch-up download among the first three)
    assert sum(count > 0 for count in served.values()) >= 3, served
    assert max(served.values()) <= 0.7 * 2 * downloads, served
    for rank in (3, 4):
        assert swarm.result(rank)["epoch"] == 2


@pytest.mark.extended  # CI budget; a 4 s peer's groupmates also wait for it in the late-joiner test below
def test_a_slow_stepping_peer_is_waited_for_not_failed(swarm):
    """A peer whose steps take 4 s joins an all-reduce only at its next step, seconds after its group formed (it
    starts matchmaking early enough: matchmaking_time 5 s). Its groupmates must wait for it (it announces its step
    period) rather than fail the round as if it were dead. One start-up race is no such failure: the slow peer can
    look for a group only from its first step on, so under load the others' first group may form before it
    (it then says the swarm completed round 1 without it, and catches up by download)."""
    epochs = 4
    common = dict(batch_size=16, target_batch_size=5000, inner="sgd", epochs=epochs, expect_peers=3,
                  matchmaking_time=5.0, averaging_timeout=AVERAGING_TIMEOUT)
    for rank in range(2):
        swarm.start(rank, step_sleep=0.03, **common)
    swarm.start(2, step_sleep=4.0, **common)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    late_at_start = "(failed: the swarm completed round 1 without this peer)"
    for r in results:
        assert r["epoch"] == epochs
        failed = [line for line in swarm.log(r["rank"]).splitlines() if "did not reach a majority of 3 peers (failed"
                  in line and not (r["rank"] == 2 and late_at_start in line)]
        assert not failed, swarm.log(r["rank"])
        assert_quiet(swarm.log(r["rank"]))
    slow = [rep for rep in results[2]["reports"] if not rep["caught_up"]]
    assert sum(rep["group_size"] == 3 for rep in slow) >= 2, results[2]["reports"]  # averaged with the others


@pytest.mark.extended  # 35 s: the default suite stays within 20 minutes
def test_a_slow_peer_that_joins_late_gets_back_into_rounds_after_catching_up(swarm):
    """A peer whose steps (4 s) are slower than the swarm's rounds (~3 s) joins a swarm already training: it catches
    up by download, and must then get into the next round's group at once. If it only looked for a group at its
    next step, that round would always have formed (and completed) before, and it would catch up again forever,
    never contributing."""
    epochs = 6
    common = dict(batch_size=16, target_batch_size=3000, inner="sgd", epochs=epochs, matchmaking_time=5.0,
                  averaging_timeout=AVERAGING_TIMEOUT)
    for rank in range(2):  # held at epoch 1 until the slow peer caught up: under load its start-up (imports, DHT,
        # download) can outlast the rest of the run, and it would join a finished swarm (a peer's max_seconds counts
        # the hold)
        (swarm.tmp / f"peer{rank}.pt.hold").touch()
        swarm.start(rank, step_sleep=0.03, expect_peers=2, hold_at_epoch=1, max_seconds=200, **common)
    deadline = time.monotonic() + 120
    while "epoch 1:" not in swarm.log(0) and time.monotonic() < deadline:
        time.sleep(0.2)
    swarm.start(2, step_sleep=4.0, expect_peers=3, **common)
    while "Loaded the swarm's state" not in swarm.log(2) and time.monotonic() < deadline + 120:
        time.sleep(0.2)
    for rank in range(2):
        (swarm.tmp / f"peer{rank}.pt.hold").unlink()
    swarm.wait(timeout=240)
    results = [swarm.result(r) for r in range(3)]
    assert "Loaded the swarm's state" in swarm.log(2)  # it did join late
    for r in results:
        assert r["epoch"] == epochs
        assert_quiet(swarm.log(r["rank"]))
    joined = [rep for rep in results[2]["reports"] if not rep["caught_up"] and rep["group_size"] == 3]
    assert len(joined) >= 2, (results[2]["reports"], swarm.log(2))


def test_a_peer_that_leaves_after_the_last_round_lets_its_groupmates_finish_it(swarm):
    """A peer ends a round as soon as its own parts are averaged, while the means it reduced may still be on their
    way to its groupmates. The first peer to finish the run's last round leaves at once (no lingering): its
    groupmate must still complete that round, with the same weights (a departure that cut the reducer's streams
    failed the groupmate's last round, and the two ended apart)."""
    epochs = 3
    common = dict(batch_size=16, target_batch_size=64, inner="sgd", epochs=epochs, expect_peers=2,
                  matchmaking_time=2.0, averaging_timeout=AVERAGING_TIMEOUT)
    swarm.start(0, linger=0.0, slow_replies=0.4, **common)  # its replies lag: it finishes each round first
    swarm.start(1, **common)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(2)]
    assert (swarm.tmp / "peer0.pt.slowed").exists()  # peer 0 did reduce a share for peer 1
    for r in results:
        assert r["epoch"] == epochs, swarm.log(r["rank"])
        assert all(rep["group_size"] == 2 and not rep["caught_up"] for rep in r["reports"]), r["reports"]
        assert_quiet(swarm.log(r["rank"]))
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


@pytest.mark.parametrize("forgets", [False, True], ids=["shuts down", "ends without shutdown"])
def test_a_peer_that_leaves_lets_its_partner_go_on_at_once(swarm, forgets):
    """One of two peers leaves while the other trains on: with ``opt.shutdown()``, or at the end of a script that
    forgot it (no ``with opt:``; ``Optimizer`` then shuts itself down at the interpreter's exit). Either way its
    record is withdrawn, so its partner neither remembers it as a peer maybe cut off (a swarm of two stalled until
    it was forgotten: 16-23 s measured) nor waits out its round's deadline for it (a round whose every other peer
    left gives up at once: the whole ``averaging_timeout`` before). The leaver exits quietly."""
    averaging_timeout = 30.0
    common = dict(batch_size=16, target_batch_size=64, inner="sgd", expect_peers=2, step_sleep=0.02,
                  matchmaking_time=1.0, averaging_timeout=averaging_timeout)
    swarm.start(0, epochs=40, **common)
    swarm.start(1, epochs=6, forgets_shutdown=forgets, linger=0.0, **common)
    assert swarm.procs[1].wait(120) == 0, swarm.log(1)
    assert_quiet(swarm.log(1))
    left = swarm.result(1)["reports"][-1]["time"]  # its last epoch, just before its script ended
    swarm.wait(timeout=200)
    reports = swarm.result(0)["reports"]
    assert any(rep["group_size"] == 2 for rep in reports), reports  # they trained together first
    after = [left] + [rep["time"] for rep in reports if rep["time"] > left]
    assert len(after) >= 10, reports  # the partner went on alone
    longest = max(b - a for a, b in zip(after, after[1:]))
    assert longest < MIN_AVERAGING_TIMEOUT, (longest, swarm.log(0))  # no round waited out a deadline (~1 s seen)


def test_a_peer_in_a_crash_loop_stalls_nobody(swarm):
    """A volunteer whose process dies soon after it starts, and is started again, a new identity each time (a crash
    loop under a supervisor). Each instance vanishes without a goodbye, so the others remember it as a peer maybe
    only cut off; remembered for ``forget_after`` (60 s) each, instances restarted every ~10 s outnumbered the two
    live peers: no group was a majority, so nothing committed, and a peer that fell behind believed no epoch ahead
    of its own and ignored the one ahead as a liar. Remembered no longer than they were seen, they leave about one
    ghost at a time: the two stable peers train through the whole loop to the end, together (the same parameters at
    every epoch), and neither ignores the other."""
    epochs = 12
    common = dict(batch_size=16, target_batch_size=2048, inner="sgd", step_sleep=0.05, matchmaking_time=1.0,
                  averaging_timeout=10.0)
    for rank in range(2):
        swarm.start(rank, epochs=epochs, expect_peers=2, max_seconds=240, **common)
    outs = [swarm.tmp / f"peer{rank}.pt" for rank in range(2)]
    deadline = time.monotonic() + 200
    incarnation = 2
    while not all(out.exists() for out in outs) and time.monotonic() < deadline:
        born = time.monotonic()
        swarm.start(incarnation, epochs=10 ** 6, **common)
        while time.monotonic() - born < 10 and "Loaded the swarm's state" not in swarm.log(incarnation):
            time.sleep(0.2)
        time.sleep(2.0)  # published its record, maybe took a step or joined a round
        swarm.kill(incarnation)
        incarnation += 1
    assert all(out.exists() for out in outs), (f"the stable peers did not finish beside {incarnation - 2} crashed "
                                               f"instances in 200 s\n{swarm.round_events()}")
    swarm.wait(timeout=60)
    assert incarnation - 2 >= 3, incarnation  # the loop ran through the training
    results = [swarm.result(rank) for rank in range(2)]
    assert [r["epoch"] for r in results] == [epochs, epochs], [r["epoch"] for r in results]
    assert all(torch.equal(p, q) for p, q in zip(*(r["params"] for r in results)))  # one model
    for rank in range(2):
        assert "Ignoring peer" not in swarm.log(rank), swarm.log(rank)
