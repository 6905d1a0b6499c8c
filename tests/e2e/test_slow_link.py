"""A state larger than a slow link carries within the download deadlines: two hosts (network namespaces) whose links
``tc tbf`` limits to 2 Mbit/s, a donor whose state (~4.6 MB) takes ~19 s to cross, and a newcomer whose download
before its first step would give up after 15 s if the state were not arriving. Skipped, with the reason, where
namespaces cannot be created (not root, no iproute2). One of the extended scenarios."""

from __future__ import annotations

import pytest

from swarm_opt import state_sync
from swarm_opt.testing import kill
from tests.e2e.conftest import cli_env
from tests.e2e.slow_link_peer import record, start
from tests.hosts import Hosts, namespaces_unavailable


@pytest.fixture
def hosts():
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    made = Hosts(2, rate="2mbit", burst="256kbit")
    try:
        yield made
    finally:
        made.close()


@pytest.mark.swarm
@pytest.mark.extended  # 28 s: the default suite stays within 20 minutes (its rule: tests/unit/test_state_download.py)
@pytest.mark.timeout(240)
def test_a_newcomer_downloads_a_state_that_takes_longer_than_its_patience_over_a_slow_link(hosts, tmp_path):
    donor_log, newcomer_log = tmp_path / "donor.log", tmp_path / "newcomer.log"
    donor = start(hosts.prefix(0), donor_log, "donor", hosts.address(0), env=cli_env())
    procs = [donor]
    try:
        maddrs = record(donor, donor_log, "maddrs", 60)["maddrs"]
        ready = record(donor, donor_log, "ready", 90)
        newcomer = start(hosts.prefix(1), newcomer_log, "newcomer", hosts.address(1), *maddrs, env=cli_env())
        procs.append(newcomer)
        assert newcomer.wait(180) == 0, newcomer_log.read_text()
        joined = record(newcomer, newcomer_log, "built_in", 0)
    finally:
        kill(procs)
    text = newcomer_log.read_text()
    # the download outlasted the newcomer's patience (a deadline fixed at 15 s gave it up, every time) ...
    assert joined["built_in"] > state_sync.NEWCOMER_PATIENCE, text
    # ... and it loaded the donor's state, not its own initial parameters
    assert joined["epoch"] == ready["epoch"] and joined["digest"] == ready["digest"], (joined, ready)
    assert "Traceback" not in text and "WARNING" not in text, text
