"""``swarm_opt._hivemind.rebootstrap``: when the watcher calls a DHT lost, whom it dials and when, and what it says.
No network: each look's answer from the DHT process is given by the test (the network behaviour is in
``tests/e2e/test_partition.py``)."""

from __future__ import annotations

import logging
from unittest.mock import create_autospec

import hivemind
import pytest

from swarm_opt._hivemind.rebootstrap import DHTWatcher, WatchConfig, _too_few, split_peer_maddr, watch_dht

BOOT = "12D3KooWKYNJpMEEJtHGKBm54cesDV3jah7SPTAdF4QTPhUiQD4r"
BOOT_MADDR = f"/ip4/10.0.0.1/tcp/31337/p2p/{BOOT}"


def test_lost_means_nobody_or_at_most_half_of_the_recent_peak():
    assert _too_few(0, 1) and _too_few(0, 5) and _too_few(2, 5) and _too_few(1, 2)
    assert not _too_few(3, 5) and not _too_few(0, 0) and not _too_few(4, 4) and not _too_few(5, 3)


def test_split_peer_maddr():
    assert split_peer_maddr(BOOT_MADDR) == (BOOT, "/ip4/10.0.0.1/tcp/31337")


class Scripted(DHTWatcher):
    """A watcher whose looks return what the test scripts: (table {peer: addrs}, peers that answered a dial[, peers
    whose hosts refused the connection])."""

    def __init__(self, answers, **config):
        super().__init__(object(), [BOOT_MADDR], WatchConfig(**config))
        self.answers, self.dialled = list(answers), []

    def _call(self, coroutine):
        self.dialled.append(sorted(peer for peer, _ in coroutine.keywords["due"]))
        table, responded, *refused = self.answers.pop(0)
        return "me", table, responded, refused[0] if refused else []


def said(caplog) -> list:
    """The watcher's own records (a test that ran before in this process may still have a thread that logs)."""
    return [r for r in caplog.records if r.name == "swarm_opt._hivemind.rebootstrap"]


def test_a_node_that_loses_its_table_says_so_dials_everyone_it_knew_and_says_when_it_sees_them_again(caplog):
    full = {BOOT: ["/ip4/10.0.0.1/tcp/31337"], "B": ["/ip4/10.0.0.2/tcp/1"], "C": ["/ip4/10.0.0.3/tcp/1"]}
    looks = [(full, []), (full, []), ({}, []), ({}, []), ({}, [BOOT]), (full, [])]
    watcher = Scripted(looks, min_backoff=100, max_backoff=100)
    with caplog.at_level(logging.INFO, logger="swarm_opt._hivemind.rebootstrap"):
        assert [watcher._look_once() for _ in range(2)] == [False, False]
        assert not said(caplog) and not watcher.lost  # healthy: silent
        assert watcher._look_once() is True and watcher.lost  # emptied: dial at once ...
        watcher._look_once()
        assert watcher.dialled[3] == sorted(full)  # ... every peer it knew, the initial one too, then say so
        assert "Lost sight of the swarm's DHT (this node sees 0 of the 3 peers" in caplog.text
        assert "re-bootstrapping from 3 known addresses" in caplog.text
        assert said(caplog)[0].levelno == logging.WARNING
        watcher._look_once()
        assert watcher.dialled[4] == []  # all are within their backoff now
        watcher._look_once()
    assert not watcher.lost and "Found the swarm's DHT again: this node sees 3 peers" in caplog.text
    assert len(said(caplog)) == 2


def test_two_cut_off_together_are_lost_though_each_sees_the_other(caplog):
    five = {p: [] for p in "ABCDE"}
    watcher = Scripted([(five, []), ({"A": []}, []), ({"A": []}, [])])
    with caplog.at_level(logging.INFO, logger="swarm_opt._hivemind.rebootstrap"):
        for _ in range(3):
            watcher._look_once()
    assert watcher.lost and "sees 1 of the 5 peers" in caplog.text


def test_peers_that_left_are_said_at_info_not_as_a_warning(caplog):
    """At a run's end the others' hosts refuse connections (nothing listens): not a partition."""
    two = {"A": ["/ip4/10.0.0.2/tcp/1"], "B": ["/ip4/10.0.0.3/tcp/1"]}
    watcher = Scripted([(two, []), ({}, []), ({}, [], [BOOT, "A", "B"]), (two, [])])
    with caplog.at_level(logging.INFO, logger="swarm_opt._hivemind.rebootstrap"):
        for _ in range(4):
            watcher._look_once()
    assert [r.levelno for r in said(caplog)] == [logging.INFO, logging.INFO]
    assert "they left" in said(caplog)[0].message and "Found the swarm's DHT again" in said(caplog)[1].message


def test_a_missing_initial_peer_is_dialled_again_with_a_growing_bounded_pause():
    watcher = Scripted([({"B": []}, [])] * 8, min_backoff=1, max_backoff=4, period=0.01)
    pauses = []
    for _ in range(8):
        watcher._known[BOOT].next_try = 0.0  # due at every look, whatever its pause
        watcher._look_once()
        pauses.append(watcher._known[BOOT].backoff)
    assert pauses[:4] == [1, 2, 4, 4] and max(pauses) == 4  # a restarted bootstrap node is called again


def test_only_a_running_dht_of_this_process_is_watched():
    assert watch_dht(create_autospec(hivemind.DHT, instance=True)) is None


def test_config_is_checked():
    with pytest.raises(ValueError, match="max_backoff"):
        WatchConfig(min_backoff=5, max_backoff=1)


def test_a_bare_tcp_connection_says_whether_a_missing_peers_host_listens_before_the_daemon_dials_it():
    """The probe that keeps the watcher's retries out of libp2p's dial backoff: a listening port answers, a closed
    one refuses (its host is up, the peer left), an address that is not plain TCP is left to the daemon (None)."""
    import asyncio
    import socket

    from swarm_opt._hivemind.rebootstrap import _ANSWERED, _REFUSED, _tcp_probe

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(1)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
    try:
        open_port, closed_port = listening.getsockname()[1], closed.getsockname()[1]
        probe = lambda addrs: asyncio.run(_tcp_probe(addrs, timeout=2.0))  # noqa: E731
        assert probe([f"/ip4/127.0.0.1/tcp/{open_port}"]) == _ANSWERED
        assert probe([f"/ip4/127.0.0.1/tcp/{closed_port}"]) == _REFUSED
        assert probe([f"/ip4/127.0.0.1/tcp/{closed_port}", f"/ip4/127.0.0.1/tcp/{open_port}"]) == _ANSWERED
        assert probe([f"/ip4/127.0.0.1/tcp/{open_port}", "/ip4/127.0.0.1/udp/4001/quic"]) is None
        assert probe([]) is None
    finally:
        listening.close()
        closed.close()
