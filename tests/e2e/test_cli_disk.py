"""A peer's checkpoint disk fills up or turns read-only while it trains: one line, the previous checkpoint intact,
training goes on; at exit a checkpoint that cannot be written makes the exit status 1, without a traceback. A
directory that cannot be written at start is refused in one line before the peer joins."""

from __future__ import annotations

import re

import pytest

import swarm_opt
from tests.disks import tiny_disk

from .test_cli_swarm import train_args


def _epoch(peer) -> int:
    found = re.findall(r"^epoch (\d+): ", peer.stdout, re.MULTILINE)
    return int(found[-1]) if found else 0


def _wait_epochs(peer, beyond: int, timeout: float) -> int:
    peer.wait_for(rf"^epoch {beyond}: ", timeout)
    return _epoch(peer)


@pytest.mark.swarm
@pytest.mark.extended
@pytest.mark.timeout(240)
def test_a_full_then_read_only_checkpoint_disk_costs_one_line_each_and_training_goes_on(cli):
    with tiny_disk(cli.workdir / "disk", size="1m") as disk:
        directory = disk.path / "ckpt"
        node, maddr = cli.dht()
        peer = cli.start("peer", *train_args("e2e_disk", maddr, "--target-batch-size", "256", "--checkpoint-dir",
                                             str(directory), "--checkpoint-every", "1"))
        peer.wait_for(r"^epoch 2: ", 120)
        disk.fill()
        peer.wait_for(r"could not write checkpoint .*: No space left on device \(ENOSPC\); free space on that "
                      r"disk or checkpoint to another one; the previous checkpoint .* is intact; training "
                      r"continues", 60, stream="stderr")
        intact = sorted(directory.glob("epoch-*.pt"))
        full_at = _epoch(peer)
        _wait_epochs(peer, full_at + 3, 60)  # training goes on, and says so once, not at every epoch
        assert peer.stderr.count("could not write checkpoint") == 1, peer.describe()
        # (a failing write's temporary file may exist right now: it is checked for once the peer is gone)
        assert sorted(directory.glob("epoch-*.pt")) == intact
        assert swarm_opt.load_checkpoint(intact[-1])["epoch"] >= 2

        disk.free()
        peer.wait_for(r"checkpoints are saved again: .*epoch-\d+\.pt", 60, stream="stderr")
        disk.read_only(directory)
        peer.wait_for(r"could not write checkpoint .*: Read-only file system \(EROFS\); .*; training continues",
                      60, stream="stderr")
        intact = sorted(directory.glob("epoch-*.pt"))
        _wait_epochs(peer, _epoch(peer) + 2, 60)

        peer.interrupt()  # Ctrl-C: the checkpoint at exit cannot be written either
        assert peer.wait(60) == 1, peer.describe()
        err = peer.stderr
        assert re.search(r"Read-only file system \(EROFS\).*; leaving without a checkpoint of epoch \d+$", err,
                         re.MULTILINE), peer.describe()
        assert "stopped by SIGINT" in err and "Traceback" not in err and err.count("EROFS") == 2, peer.describe()
        assert sorted(directory.glob("epoch-*.pt")) == intact and not list(directory.glob(".*.tmp"))  # none left
        assert swarm_opt.load_checkpoint(intact[-1])["epoch"] > full_at
        node.interrupt()
        assert node.wait(30) == 0, node.describe()
        assert not cli.leftovers(wait=15), cli.leftovers()


@pytest.mark.timeout(120)
def test_a_read_only_checkpoint_directory_is_refused_before_joining(cli):
    with tiny_disk(cli.workdir / "disk", size="1m") as disk:
        (disk.path / "ckpt").mkdir()
        disk.read_only(disk.path)
        # no DHT runs at this address: the refusal comes before the peer tries to join
        done = cli.run(*train_args("e2e_ro", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJoKpdvcL6r24m2sCAKqb3kxPoKgjp8maxfer7"
                                   "VwWAQLd", "--checkpoint-dir", str(disk.path / "ckpt")))
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert re.search(r"--checkpoint-dir .*ckpt: cannot write checkpoints in .*ckpt: Read-only file system "
                         r"\(EROFS\); the file system is mounted read-only: remount it read-write", lines[0]), lines
