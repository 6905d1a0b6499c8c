"""The gloo fast lane in real loopback swarms: equivalence with one process, a member killed mid-round, a swarm
with a client-mode peer (hivemind's path for its groups), no threads or sockets leaked over many rounds, and two
averagers whose host processes run the lane's rounds."""

from __future__ import annotations

import time

import pytest
import torch

from tests.swarm.peer import make_model
from tests.swarm.test_grad_averaging import assert_one_process as one_process
from tests.swarm.test_grad_averaging import assert_quiet

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


def test_lane_peers_equal_one_process_on_the_union_of_batches(swarm):
    """Three lane peers of unequal batch sizes end with the parameters of one process that applies the inner
    optimizer to the union of the batches of each epoch, and their rounds went over the lane."""
    epochs = 4
    for rank, batch_size in enumerate([8, 12, 20]):
        swarm.start(rank, batch_size=batch_size, target_batch_size=240, inner="adam", epochs=epochs,
                    expect_peers=3, step_sleep=0.03, lane=True)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    assert_one_process(swarm, results, "adam", epochs)
    averaged = [sum(not rep["caught_up"] and rep["group_size"] >= 2 for rep in r["reports"]) for r in results]
    # every round a peer averaged went over the lane (a peer late on a loaded machine may catch up instead; a lane
    # round that completed and was then discarded by the commit rule counts as a lane round, not as averaged)
    assert all(lane >= n for lane, n in zip([r["lane_rounds"] for r in results], averaged)) \
        and min(averaged) >= 1 and max(averaged) >= epochs // 2, \
        ([r["lane_rounds"] for r in results], [r["reports"] for r in results])


@pytest.mark.extended
def test_a_swarm_with_a_client_mode_peer_trains_its_groups_through_hivemind(swarm):
    """A client-mode peer offers no lane: the groups it is in average through hivemind, the others may use the lane;
    the swarm still equals one process."""
    epochs = 4
    for rank, batch_size in enumerate([8, 12, 20]):
        swarm.start(rank, batch_size=batch_size, target_batch_size=240, inner="sgd", epochs=epochs,
                    expect_peers=3, step_sleep=0.03, lane=True, client_mode=rank == 2)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    assert_one_process(swarm, results, "sgd", epochs)
    client = results[2]
    assert client["lane_rounds"] == 0
    assert any(rep["group_size"] == 3 for rep in client["reports"]), "the client never averaged"
    assert "gloo lane is off for this peer" in swarm.log(2)


@pytest.mark.extended
def test_a_member_killed_inside_a_lane_all_reduce_stalls_nobody_beyond_one_round(swarm):
    """SIGKILL one of four lane peers while its tensors go into a lane all-reduce (its weights already summed with
    the group's): the others fail that round at once, go on with the survivors over the lane, and agree."""
    epochs = 8
    for rank in range(4):
        swarm.start(rank, batch_size=16, target_batch_size=256, inner="sgd", epochs=epochs, expect_peers=4,
                    step_sleep=0.03, averaging_timeout=15.0, lane=True,
                    **(dict(die_in_lane=True, arm_at_epoch=3) if rank == 1 else {}))
    deadline = time.monotonic() + 120
    while swarm.procs[1].poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert swarm.procs[1].poll() is not None, "the victim never died in a lane round"
    swarm.procs.pop(1)
    survivors = [0, 2, 3]
    swarm.wait(timeout=150)
    results = [swarm.result(r) for r in survivors]
    for r in results:
        assert r["epoch"] == epochs
        assert_quiet(swarm.log(r["rank"]))
        assert max(rep["seconds"] for rep in r["reports"]) < 12.0, r["reports"]  # no round waited for the dead
        assert all(torch.isfinite(p).all() for p in r["params"])
    for r in results[1:]:
        for got, want in zip(r["params"], results[0]["params"]):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    last = [rep for rep in results[0]["reports"] if not rep["caught_up"]][-1]
    assert last["group_size"] == 3 and results[0]["lane_rounds"] >= 4, (results[0]["lane_rounds"],
                                                                        results[0]["reports"])


@pytest.mark.extended
def test_many_lane_rounds_leak_no_threads_or_sockets(swarm):
    """Two lane peers average many rounds; the user's process (where the lane runs its rounds) and the averager
    process (which forms the groups) hold as many threads and file descriptors at the end as after the first
    rounds."""
    epochs = 120
    for rank in range(2):
        swarm.start(rank, batch_size=16, target_batch_size=32, inner="sgd", epochs=epochs, expect_peers=2,
                    step_sleep=0.01, matchmaking_time=0.5, averaging_timeout=10.0, lane=True,
                    count_resources=True)
    swarm.wait(timeout=280)
    for rank in range(2):
        r = swarm.result(rank)
        assert r["epoch"] == epochs and r["lane_rounds"] >= epochs - 5, (r["lane_rounds"], r["reports"])
        counts = r["resources"]
        for process in ("averager", "host"):
            for what in ("fds", "threads"):
                # streams come and go on top of what the process holds (each DHT request or stream to p2pd is a
                # socket while in flight: more of them at once on a loaded machine, whose load changes over the
                # test: a window's floor rose by 2 in CI); a leak raises the floor under them, one per 25 rounds by
                # 4 between these windows (~100 rounds apart); on a quiet machine the floor is flat over 150 rounds
                early = [counts[e][process][what] for e in counts if 5 <= e <= 14]
                late = [counts[e][process][what] for e in counts if e > epochs - 10]
                assert late and min(late) <= min(early) + 3, (process, what,
                                                              {e: c[process] for e, c in counts.items()})


def assert_one_process(swarm, results: list, inner: str, epochs: int) -> None:
    """Every peer finished quietly with the same parameters, those of one process that applied the inner optimizer
    to the union of the batches of each epoch (the helpers of tests/swarm/test_grad_averaging.py)."""
    for r in results:
        assert r["epoch"] == epochs
        assert all(rep["caught_up"] or rep["group_size"] >= 2 for rep in r["reports"]), r["reports"]
        assert_quiet(swarm.log(r["rank"]))
    references = one_process(results, inner, epochs)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(references[0], make_model().parameters()))


@pytest.mark.extended
def test_a_private_run_averages_over_the_lane_under_keys_derived_from_its_secret(swarm):
    """Two members of a private run (a run secret) offer the lane and average over it."""
    epochs = 3
    for rank in range(2):
        swarm.start(rank, batch_size=16, target_batch_size=96, inner="sgd", epochs=epochs, expect_peers=2,
                    step_sleep=0.02, lane=True, secret="a run secret of enough length for the lane")
    swarm.wait(timeout=150)
    results = [swarm.result(r) for r in range(2)]
    for r in results:
        assert r["epoch"] == epochs and r["lane_rounds"] >= 1, (r["lane_rounds"], r["reports"])
        assert_quiet(swarm.log(r["rank"]))
    for got, want in zip(results[1]["params"], results[0]["params"]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_two_averagers_run_lane_rounds_in_their_own_process_and_discard_a_poisoned_one_at_once():
    """Two ``TensorAverager``s on two real DHTs, each with the lane: the host process runs the round (its lane
    serves the rendezvous here, the averager process only forms the group). A round matched ahead for the lane
    sends unchecked: one member's NaN reaches the sum, both discard that round at once (not after a start
    timeout) and the next round, in the same cached process group, is the weighted mean again. Each round's step in
    the averager process ends once the host told it the verdict."""
    import threading

    import hivemind
    from hivemind.utils import get_dht_time

    from swarm_opt import Gloo, NoCompression
    from swarm_opt._hivemind.tensor_averager import TensorAverager
    from swarm_opt.config import Timeouts

    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = hivemind.DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    timeouts = Timeouts(matchmaking_time=1.0, averaging_timeout=10.0)
    averagers = []
    try:
        averagers = [TensorAverager(dht, prefix="host_lane", templates=[torch.zeros(300_000), torch.zeros(5)],
                                    timeouts=timeouts, compression=NoCompression(), lane=Gloo(host="127.0.0.1"))
                     for dht in (first, second)]
        assert all(a._engine.lane._store is not None for a in averagers)  # served by this (the host) process

        def average(round_id: int, values: list) -> list:
            for averager in averagers:  # matched ahead, as a peer that schedules its next round while it computes
                averager.schedule(get_dht_time(), round_id)
            deadline = time.monotonic() + 30
            # ... and the host heard that the group formed for the lane (a pipe message, which can arrive after the
            # step shows it matched: a host that calls all_reduce before checks its values, as for hivemind's path)
            while not all(a._lane_formed(round_id) for a in averagers) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert all(a._lane_formed(round_id) for a in averagers), [a.last_failure for a in averagers]
            steps = [a._scheduled for a in averagers]  # each averager process's step of this round
            results: list = [None, None]

            def run(i: int) -> None:
                started = time.monotonic()
                result = averagers[i].all_reduce(lambda buffers: [b.fill_(values[i]) for b in buffers], i + 1.0,
                                                 round_id)
                results[i] = (result, time.monotonic() - started, averagers[i].last_failure)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            for step in steps:  # the host told it the verdict (after returning): it ended, not at its timeout
                assert isinstance(step.result(timeout=2), dict)
            return results

        for result, _, failure in average(1, [1.0, 4.0]):
            assert result is not None and len(result.peers) == 2, failure
            assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in result.averaged)  # (1·1 + 2·4) / 3
        for result, seconds, failure in average(2, [float("nan"), 4.0]):
            assert result is None and failure == "non-finite averaged values" and seconds < 2.0, (failure, seconds)
        for result, _, failure in average(3, [2.0, 5.0]):
            assert result is not None, failure
            assert all(torch.equal(t, torch.full_like(t, 4.0)) for t in result.averaged)
        assert [a.lane_rounds for a in averagers] == [3, 3]
        # the bytes the lane moved are counted as traffic, the poisoned round's too (they crossed the wire): 3 rounds
        # of 300,005 fp32 values, each member sending and receiving 2 (n - 1) / n of them with n = 2
        moved = 3 * 300_005 * 4
        assert all(a.traffic == (moved, moved) for a in averagers), [a.traffic for a in averagers]
        assert all(len(a._engine.lane._groups) == 1 for a in averagers)  # one process group served all three
    finally:
        for averager in averagers:
            averager.shutdown()
        second.shutdown()
        first.shutdown()
