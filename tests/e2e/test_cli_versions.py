"""Peers of two swarm_opt releases meet in one run (swarm_opt.protocol): the newcomer is refused in one line naming
the release to install, whichever of the two is newer, and the peers already training go on, undisturbed. The
previous release is a real peer of protocol 1 (``tests/e2e/previous_release.py``)."""

from __future__ import annotations

import re

import pytest

from swarm_opt import protocol

from .test_cli_swarm import train_args

OLD = "tests.e2e.previous_release"


def _refused(newcomer) -> str:
    """A volunteer that must exit 2 with one line and no traceback: that line."""
    assert newcomer.wait(150) == 2, newcomer.describe()
    lines = newcomer.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in newcomer.stderr, newcomer.describe()
    return lines[0]


@pytest.mark.swarm
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_volunteer_of_the_other_release_is_refused_in_one_line_naming_the_release_both_ways(cli):
    _, maddr = cli.dht()
    new_run = cli.start("new_peer", *train_args("e2e_new", maddr))
    old_run = cli.start("old_peer", *train_args("e2e_old", maddr), module=OLD)
    for peer in (new_run, old_run):
        peer.wait_for(r"^epoch 1: ", 120)
    # a volunteer of each release joins the other release's run, both at once
    old_newcomer = cli.start("old_newcomer", *train_args("e2e_new", maddr), module=OLD)
    new_newcomer = cli.start("new_newcomer", *train_args("e2e_old", maddr))

    # the previous release's volunteer reads this release's recipe with its own (unchanged) check
    line = _refused(old_newcomer)
    assert (f"run 'e2e_new': this run trains with swarm_opt=\"{protocol.label()}\"; your recipe says "
            f"swarm_opt=(none)") in line
    # this release's volunteer in a run of the previous release
    line = _refused(new_newcomer)
    assert ("run 'e2e_old': its live peers run swarm_opt protocol 1, an older release: install "
            "'swarm_opt>=0.1.0,<0.2.0' to train with them (this peer runs protocol 2, 'swarm_opt>=0.2.0')") in line

    for peer in (new_run, old_run):  # neither run noticed more than a record it does not read
        reached = max(map(int, re.findall(r"^epoch (\d+): ", peer.stdout, re.MULTILINE)))
        peer.wait_for(rf"^epoch {reached + 1}: ", 60)
        assert peer.proc.poll() is None, peer.describe()
        assert "Traceback" not in peer.stderr and "ERROR" not in peer.stderr, peer.describe()


@pytest.mark.swarm
@pytest.mark.extended
@pytest.mark.timeout(240)
def test_a_checkpoint_of_the_previous_release_resumes_after_an_upgrade(cli):
    _, maddr = cli.dht()
    old = cli.start("old_peer", *train_args("e2e_upgrade", maddr, "--checkpoint-dir", "ckpt", "--epochs", "3"),
                    module=OLD)
    assert old.wait(120) == 0, old.describe()
    new = cli.start("new_peer", *train_args("e2e_upgrade", maddr, "--checkpoint-dir", "ckpt", "--epochs", "5"))
    assert new.wait(120) == 0, new.describe()
    assert "resumed from" in new.stderr and "(epoch 3)" in new.stderr, new.describe()
    assert re.search(r"^epoch 4: ", new.stdout, re.MULTILINE) and "epoch 1:" not in new.stdout, new.describe()
