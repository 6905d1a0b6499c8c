"""What a progress tracker remembers of the swarm, on real hivemind DHTs: a peer that left cleanly is forgotten at
once, one whose record merely vanished (crashed, or cut off by the network) counts in the swarm's size for
``TrackerConfig.forget_after`` (no longer than it had been seen: a crash loop leaves no crowd of ghosts), and a view
settles only seconds after the last new peer appeared."""

from __future__ import annotations

import time

import hivemind
import pytest

from swarm_opt.config import TrackerConfig
from swarm_opt.progress import ProgressTracker

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


def _wait(condition, timeout: float, what) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


def _tracker(dht, config: TrackerConfig) -> ProgressTracker:
    tracker = ProgressTracker(dht, "memory_run", 1000, model_schema="m", config=config)
    tracker.mark_joined()
    tracker.report(0, 8)
    tracker.start()
    return tracker


def test_a_vanished_peer_counts_for_forget_after_and_one_that_left_not_at_all():
    config = TrackerConfig(record_ttl=2.5, forget_after=6.0)
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    others = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           initial_peers=first.get_visible_maddrs()) for _ in range(2)]
    trackers = []
    try:
        watcher, leaving, vanishing = trackers[:] = [_tracker(dht, config) for dht in [first, *others]]
        view = lambda: watcher.progress  # noqa: E731
        _wait(lambda: view().num_peers == 3, 20, view)
        assert view().recent_peers == 3 and view().max_peers == 3

        leaving.shutdown()  # leaves cleanly: withdraws its record, and is forgotten at once
        _wait(lambda: view().num_peers == 2 and view().recent_peers == 2, 10, view)

        time.sleep(config.forget_after)  # seen that long: remembered that long (a peer seen briefly, less)
        vanishing._stop.set()  # stops publishing without a word (a crash, or a cut link): its record expires
        _wait(lambda: view().num_peers == 1, 15, view)
        vanished = time.monotonic()
        assert view().recent_peers == 2 and view().max_peers == 2, view()  # still counted: maybe only cut off
        _wait(lambda: view().recent_peers == 1, 15, view)
        assert time.monotonic() - vanished >= config.forget_after - config.record_ttl - 1.0
    finally:
        for tracker in trackers:
            tracker.shutdown(timeout=2.0)
        for dht in [*others, first]:
            dht.shutdown()


def test_a_peer_seen_briefly_or_restarted_is_not_remembered_for_forget_after():
    """A volunteer whose process crashes and restarts in a loop: each short-lived instance that vanishes counts only
    about as long as it had been seen (at least ``record_ttl``), not ``forget_after``, and an instance that
    comes back under the same peer id replaces the one it restarted at once (else the ghosts outnumber the live peers:
    nothing commits, and a peer behind takes the peers ahead for liars). One seen longer counts longer."""
    config = TrackerConfig(record_ttl=2.5, forget_after=40.0)
    dhts = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    dhts += [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dhts[0].get_visible_maddrs())
             for _ in range(2)]
    trackers = []
    try:
        watcher = _tracker(dhts[0], config)
        trackers.append(watcher)
        view = lambda: watcher.progress  # noqa: E731
        brief = _tracker(dhts[1], config)
        trackers.append(brief)
        _wait(lambda: view().num_peers == 2, 20, view)
        brief._stop.set()  # seen for a second or two, then gone without a word (SIGKILLed)
        _wait(lambda: view().num_peers == 1, 15, view)
        vanished = time.monotonic()
        _wait(lambda: view().recent_peers == 1, 15, view)  # not for forget_after (40 s)
        assert time.monotonic() - vanished < 12, view()

        steady = _tracker(dhts[2], config)
        trackers.append(steady)
        _wait(lambda: view().num_peers == 2, 20, view)
        time.sleep(10)  # seen for 10 s: remembered for 10 s once it vanishes
        steady._stop.set()
        _wait(lambda: view().num_peers == 1, 15, view)
        assert view().recent_peers == 2, view()
        restarted = _tracker(dhts[2], config)  # the same peer id, a new instance, within those 10 s
        trackers.append(restarted)
        _wait(lambda: view().num_peers == 2, 15, view)
        assert view().recent_peers == 2, view()  # the restart replaced its previous instance: no ghost beside it
    finally:
        for tracker in trackers:
            tracker.shutdown(timeout=2.0)
        for dht in reversed(dhts):
            dht.shutdown()


def test_a_view_settles_seconds_after_the_last_new_peer_appeared():
    """A peer alone settles only once its record has been stored for a few reads' time (2 s at least): a peer that
    starts beside it would show up by then. Once another peer publishes its record, the view grew: it settles again
    only seconds later, and so does the newcomer's."""
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    trackers = [_tracker(first, TrackerConfig())]
    second = None
    try:
        started = time.monotonic()
        _wait(lambda: trackers[0].settled, 10, lambda: "never settled")
        assert time.monotonic() - started >= 1.5
        second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                              initial_peers=first.get_visible_maddrs())
        trackers.append(_tracker(second, TrackerConfig()))
        _wait(lambda: not trackers[0].settled, 10, lambda: "a new peer did not unsettle the view")
        unsettled = time.monotonic()
        _wait(lambda: trackers[0].settled and trackers[1].settled, 15, lambda: "never settled again")
        assert time.monotonic() - unsettled >= 1.0
        assert trackers[0].progress.num_peers == trackers[1].progress.num_peers == 2
    finally:
        for tracker in trackers:
            tracker.shutdown(timeout=2.0)
        for dht in filter(None, [second, first]):
            dht.shutdown()
