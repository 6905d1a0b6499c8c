"""Round deadlines that follow the swarm's measured rounds (``swarm_opt.deadlines``), with real peers."""

from __future__ import annotations

import pytest

from swarm_opt.deadlines import AVERAGING_MARGIN, AVERAGING_SLACK, MIN_AVERAGING_TIMEOUT
from tests.swarm.test_grad_averaging import assert_one_process

# ~76 s of real peers: an extended scenario (the default suite keeps within 20 minutes)
pytestmark = [pytest.mark.swarm, pytest.mark.extended, pytest.mark.timeout(300)]

BOUNDS = (5.0, 60.0)  # the product's defaults: matchmaking_time, averaging_timeout
SLOW_FROM, EPOCHS = 9, 15
SLOW_REPLIES = 2.0  # seconds each reducer waits before each averaged part it sends back, from epoch SLOW_FROM on


def test_deadlines_shrink_on_a_fast_swarm_and_grow_back_when_it_turns_slow(swarm):
    """Three peers at the default bounds: once a few rounds committed, each round's averaging deadline is a
    fraction of the 60 s bound (a member that stops sending is dropped sooner). Then every reducer delays its
    replies (a swarm whose links or machines became slow): the deadline grows back, its rounds still commit, and
    the run still equals one process on the union of the batches."""
    for rank in range(3):
        swarm.start(rank, batch_size=16, target_batch_size=96, inner="sgd", epochs=EPOCHS, step_sleep=0.02,
                    matchmaking_time=BOUNDS[0], averaging_timeout=BOUNDS[1], expect_peers=3,
                    slow_replies=SLOW_REPLIES, slow_from_epoch=SLOW_FROM)
    swarm.wait(timeout=280)
    results = [swarm.result(r) for r in range(3)]
    for r in results:
        assert r["epoch"] == EPOCHS, swarm.round_events()
    assert_one_process(results, "sgd", EPOCHS)
    for r in results:
        deadlines = {report["epoch"]: report["deadlines"] for report in r["reports"]}
        assert all(m <= BOUNDS[0] and a <= BOUNDS[1] for m, a in deadlines.values())
        fast = min(a for epoch, (_, a) in deadlines.items() if epoch < SLOW_FROM)
        # shrank on the fast swarm, to what its rounds took (a loaded machine's rounds take seconds: the deadline is
        # then more than a third of the bound, as it should be); ``seconds`` of a round counts from its search, so
        # its longest bounds from above what the deadline followed
        took = max(report["seconds"] for report in r["reports"] if report["epoch"] < SLOW_FROM and report["group_size"])
        assert fast < BOUNDS[1] and fast <= max(MIN_AVERAGING_TIMEOUT, BOUNDS[0] + AVERAGING_MARGIN * took
                                                + AVERAGING_SLACK), (took, deadlines)
        slow = max(a for epoch, (_, a) in deadlines.items() if epoch > SLOW_FROM + 1)
        # and grew back once its rounds took longer: by AVERAGING_MARGIN x the delay on a quiet machine; a loaded one
        # changes the rounds' times between the two phases by a second or more (with 1 s of delay it came out below)
        assert slow >= fast + 1.5 * SLOW_REPLIES, deadlines
