"""Joining through initial peers, on real hivemind DHTs: an address whose port answers but holds no DHT peer of
that id (a wrong peer id) is one clear error after a second look, not a wait for ``join_timeout``."""

from __future__ import annotations

import time

import hivemind
import pytest

from swarm_opt._hivemind.node import start_dht
from swarm_opt.errors import ConfigError

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


def test_a_wrong_peer_id_at_a_live_port_is_one_error_after_a_second_look():
    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        real = str(node.get_visible_maddrs()[0])
        other = "12D3KooWQcnL2JAhp7jKSbKp3zGatf2kAmgNwAAdD2ggDc7kcE27"  # a valid peer id, not this node's
        wrong = real.rsplit("/p2p/", 1)[0] + "/p2p/" + other
        started = time.monotonic()
        with pytest.raises(ConfigError, match="its port accepts connections, but no DHT peer with this peer id"):
            start_dht(initial_peers=[wrong], host_maddrs=["/ip4/127.0.0.1/tcp/0"], join_timeout=300)
        assert time.monotonic() - started < 90  # two tries, not the 300 s of join_timeout
    finally:
        node.shutdown()
