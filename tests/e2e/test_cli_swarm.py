"""``swarm-opt dht``, ``train`` and ``monitor`` together on loopback, run and stopped the way a user does."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

import swarm_opt
from swarm_opt import testing

FAST_ROUNDS = ["--matchmaking-time", "1", "--averaging-timeout", "15"]


def train_args(run_id: str, maddr: str, *extra: str) -> list:
    return ["train", "--run-id", run_id, "--initial-peers", maddr, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            "--task", "digits", *FAST_ROUNDS, *extra]


def load_checkpoint(directory) -> dict:
    """The newest checkpoint of a peer's --checkpoint-dir, validated by swarm_opt's own loader."""
    paths = sorted(directory.glob("epoch-*.pt"))
    assert paths, f"no checkpoint in {directory}"
    return swarm_opt.load_checkpoint(paths[-1])


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_dht_prints_its_address_stops_on_ctrl_c_and_keeps_its_identity(cli):
    node, first = cli.dht("--identity-path", "keys/dht.id")
    peer_id = first.rsplit("/", 1)[1]
    assert f"peer id {peer_id}" in node.wait_for("running", 10, stream="stderr").string
    assert (cli.workdir / "keys" / "dht.id").stat().st_mode & 0o777 == 0o400
    node.interrupt()
    assert node.wait(30) == 0, node.describe()
    assert "Traceback" not in node.stderr and node.stderr.strip().endswith("swarm-opt dht: stopped")
    assert not cli.leftovers(wait=10), cli.leftovers()

    again, second = cli.dht("--identity-path", "keys/dht.id")
    assert second.rsplit("/", 1)[1] == peer_id  # the address others saved still names this node
    again.proc.terminate()  # SIGTERM, as a service manager stops it
    assert again.wait(30) == 0, again.describe()


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_two_peers_and_a_helper_train_and_checkpoint(cli):
    _, maddr = cli.dht()
    # rounds of a fraction of a second: enough of them for the helper (it reads the run's progress about once a
    # second) to join some; once in a group, the trainers' leaders wait for it
    epochs = 12
    common = train_args("e2e_digits", maddr, "--target-batch-size", "2048", "--epochs", str(epochs),
                        "--min-peers", "2")
    helper = cli.start("helper", *common, "--auxiliary")  # reduces a share of the rounds, trains nothing
    helper.wait_for("helping run", 60, stream="stderr")  # up before the first round
    peers = [cli.start("peer0", *common, "--checkpoint-dir", "ckpt0"),
             cli.start("peer1", *common, "--checkpoint-dir", "ckpt1", "--data-seed", "1")]
    for peer in peers + [helper]:
        assert peer.wait(120) == 0, peer.describe()
    helped = re.search(r"helped (\d+) round\(s\), reduced ([\d,]+) values; done", helper.stderr)
    assert helped and int(helped.group(1)) >= 1, helper.describe()
    assert "Traceback" not in helper.stderr and "epoch" not in helper.stdout, helper.describe()
    for rank, peer in enumerate(peers):
        lines = re.findall(r"^epoch (\d+): test accuracy [\d.]+%", peer.stdout, re.MULTILINE)
        assert lines and lines[-1] == str(epochs), peer.describe()
        assert f"reached epoch {epochs}; done" in peer.stderr and "Traceback" not in peer.stderr, peer.describe()
        state = load_checkpoint(cli.workdir / f"ckpt{rank}")
        assert state["optimizer"]["swarm_opt"]["epoch"] == epochs
    # averaging keeps the peers' models identical
    models = [load_checkpoint(cli.workdir / f"ckpt{r}")["model"] for r in range(2)]
    for key in models[0]:
        torch.testing.assert_close(models[0][key], models[1][key], rtol=1e-5, atol=1e-5)


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_monitor_shows_a_live_run_and_ctrl_c_leaves_with_a_checkpoint(cli):
    _, maddr = cli.dht()
    common = train_args("e2e_live", maddr, "--target-batch-size", "1024", "--min-peers", "2")
    peers = [cli.start("peer0", *common, "--checkpoint-dir", "ckpt0"),
             cli.start("peer1", *common, "--checkpoint-dir", "ckpt1", "--client-mode")]
    watcher = cli.start("watch", "monitor", "--run-id", "e2e_live", "--initial-peers", maddr, "--interval", "0.5",
                        "--plot", "progress.png")
    for peer in peers:
        peer.wait_for(r"^epoch 2: ", 120)

    snapshot = cli.run("monitor", "--run-id", "e2e_live", "--initial-peers", maddr, "--once",
                       "--target-batch-size", "1024")
    assert snapshot.returncode == 0, snapshot.stderr
    epoch = int(re.search(r"^run e2e_live: epoch (\d+), peers 2 \(1 in client mode\)", snapshot.stdout,
                          re.MULTILINE).group(1))
    assert epoch >= 2, snapshot.stdout
    assert len(re.findall(r"^  peer \w+  epoch \d+ .* samples/s  last seen [\d.]+ s ago", snapshot.stdout,
                          re.MULTILINE)) == 2, snapshot.stdout
    assert "/1024 samples" in snapshot.stdout

    nobody = cli.run("monitor", "--run-id", "no_such_run", "--initial-peers", maddr, "--once", "--wait", "1")
    assert nobody.returncode == 1 and nobody.stderr.count("\n") == 1, nobody.stderr
    assert "no live peers found for run 'no_such_run'" in nobody.stderr

    for process in peers + [watcher]:
        process.interrupt()  # Ctrl-C mid-run
    for rank, peer in enumerate(peers):
        assert peer.wait(60) == 0, peer.describe()
        assert "stopped by SIGINT" in peer.stderr and "Traceback" not in peer.stderr, peer.describe()
        stopped_at = int(re.search(r"saved checkpoint .* \(epoch (\d+)\)", peer.stderr).group(1))
        state = load_checkpoint(cli.workdir / f"ckpt{rank}")
        assert state["optimizer"]["swarm_opt"]["epoch"] == stopped_at >= 2
    assert watcher.wait(30) == 0, watcher.describe()
    assert (cli.workdir / "progress.png").stat().st_size > 1000
    assert re.search(r"^\[[\d:]+\] run e2e_live: epoch \d+", watcher.stdout, re.MULTILINE), watcher.describe()


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_two_peers_on_the_gloo_lane_average_there(cli):
    _, maddr = cli.dht()
    common = train_args("e2e_lane", maddr, "--target-batch-size", "256", "--epochs", "3", "--min-peers", "2",
                        "--gloo-lane", "127.0.0.1")
    peers = [cli.start("peer0", *common), cli.start("peer1", *common, "--data-seed", "1")]
    for peer in peers:
        assert peer.wait(120) == 0, peer.describe()
        lane = re.search(r"reached epoch 3, (\d+) round\(s\) over the gloo lane; done", peer.stderr)
        assert lane and int(lane.group(1)) >= 1, peer.describe()
        assert "Traceback" not in peer.stderr and "WARNING" not in peer.stderr, peer.describe()


@pytest.mark.swarm
@pytest.mark.extended
@pytest.mark.timeout(240)
def test_ctrl_c_while_a_newcomer_joins_is_heard(cli):
    """A newcomer's construction waits for the swarm's state (up to NEWCOMER_PATIENCE seconds): a Ctrl-C then must be
    heard at once and stop the peer before it trains (it was once ignored there, and the peer went on to train)."""
    _, maddr = cli.dht()
    common = train_args("e2e_join_ctrl_c", maddr, "--target-batch-size", "256")
    # in client mode the only peer cannot serve its state: a newcomer waits for a donor
    cli.start("founder", *common, "--client-mode").wait_for(r"^epoch 2: ", 120)
    newcomer = cli.start("newcomer", *common, "--data-seed", "1", "-v")
    newcomer.wait_for("downloading its state before the first step", 120, stream="stderr")
    newcomer.interrupt()
    newcomer.wait_for("stopping after the current step", 20, stream="stderr")
    assert newcomer.wait(90) == 0, newcomer.describe()
    assert "Traceback" not in newcomer.stderr and not re.search(r"^epoch \d+:", newcomer.stdout, re.MULTILINE)
    deadline = time.monotonic() + 10
    while testing.session_members(newcomer.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not testing.session_members(newcomer.proc.pid), "the newcomer left processes behind (DHT, p2pd, averager)"


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_ctrl_c_at_any_moment_of_start_up_stops_the_peer_cleanly(cli):
    """Ctrl-C (SIGINT to the peer's whole process group) while it imports, builds its task, starts its DHT and p2p
    daemon, joins and downloads the swarm's state, or has just begun to train: each time it exits promptly (130
    before it joined, 0 after, with the line that says so), with no traceback and nothing left behind. Once, under
    load, a newcomer's Ctrl-C during start-up went unheard and it trained on; once a DHT process forked at that
    moment took the trainer's handler and died with a traceback; once a Ctrl-C inside torch's import came out as a
    RecursionError."""
    _, maddr = cli.dht()
    common = train_args("e2e_startup_ctrl_c", maddr, "--target-batch-size", "256")
    cli.start("founder", *common).wait_for(r"^epoch 2: ", 120)  # a live run: a newcomer downloads its state
    # from 1 s: a signal before Python has started is the interpreter's (it dies of it, as any program does)
    for attempt, delay in enumerate((1.0, 2.5, 4.0, 5.5, 7.0, 9.0)):
        peer = cli.start(f"newcomer{attempt}", *common, "--data-seed", str(attempt + 1))
        time.sleep(delay)
        peer.interrupt()
        code = peer.wait(60)
        said = f"Ctrl-C {delay} s after the start:\n{peer.describe()}"
        assert (code, "interrupted" in peer.stderr, "stopped by SIGINT" in peer.stderr) in ((130, True, False),
                                                                                         (0, False, True)), said
        assert "Traceback" not in peer.stderr and "Exception ignored" not in peer.stderr, said
        deadline = time.monotonic() + 10
        while testing.session_members(peer.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not testing.session_members(peer.proc.pid), f"left processes behind; {said}"


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_a_peer_late_to_the_last_round_takes_the_final_state_from_peers_that_stay(cli):
    """Three volunteers train to ``--epochs 3``; one is paused once it finished epoch 2, so the other two commit the
    last epoch without it. Having reached ``--epochs``, they stay donors while it stands at an earlier epoch: it then
    downloads the final state instead of computing a second version of epoch 3 alone (they withdraw their records as
    they leave: it would see a swarm of one, and did, 1 run of 2, without the stay). One model in the end."""
    _, maddr = cli.dht()
    epochs = 3
    common = train_args("e2e_last_round", maddr, "--target-batch-size", "32768", "--epochs", str(epochs),
                        "--min-peers", "3")
    peers = [cli.start(f"peer{rank}", *common, "--checkpoint-dir", f"ckpt{rank}", "--data-seed", str(rank))
             for rank in range(3)]
    late = peers[2]
    late.wait_for(rf"^epoch {epochs - 1}: test accuracy", 150)
    # paused until the others committed the last epoch, for at most 5 s: its record (published every second) lives
    # record_ttl = 6 s, and a peer whose record expired is no longer waited for (by design: it may be dead)
    os.kill(late.proc.pid, signal.SIGSTOP)  # its trainer only: its DHT and averager processes run on
    try:
        deadline = time.monotonic() + 5.0
        while not (committed := re.search(rf"^epoch {epochs}: ", peers[0].stdout, re.MULTILINE)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(late.proc.pid, signal.SIGCONT)
    for peer in peers:
        assert peer.wait(120) == 0, peer.describe()
        assert f"reached epoch {epochs}; done" in peer.stderr and "Traceback" not in peer.stderr, peer.describe()
    # (a peer that trained the last epoch alone says "averaged with 1 of 1 peer(s)" there). Where the others had not
    # committed it within the pause (a loaded machine), or the late peer's round was already under way when the
    # pause came (its averager process runs on: seen once, "3 of 3"), it was one of them: one model still
    without_late = committed and re.search(rf"^epoch {epochs}: .*averaged with 2 of", peers[0].stdout, re.MULTILINE)
    if without_late:
        assert re.search(rf"^epoch {epochs}: .*caught up by downloading the swarm's state", late.stdout,
                         re.MULTILINE), late.describe()
    models = [load_checkpoint(cli.workdir / f"ckpt{rank}")["model"] for rank in range(3)]
    for model in models[1:]:
        for key in models[0]:
            torch.testing.assert_close(model[key], models[0][key], rtol=0, atol=0)
