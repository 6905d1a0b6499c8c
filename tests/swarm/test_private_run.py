"""Private runs: peers without the run's secret change nothing in it and are told why."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from swarm_opt import testing
from tests.swarm.conftest import REPO

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

SECRET = "correct horse battery staple 42"


def run_tool(args: list, swarm, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=str(REPO),
                          env=testing.peer_env(), start_new_session=True)


def test_strangers_without_the_secret_neither_join_nor_read_nor_take_the_state(swarm):
    epochs = 4
    for rank in range(2):
        swarm.start(rank, inner="sgd", batch_size=8, target_batch_size=64, epochs=epochs, expect_peers=2,
                    secret=SECRET, max_seconds=120, linger=120.0)
    # a stranger training the same model with the wrong secret, and one with none: their DHTs cannot start
    for rank, secret in ((2, "a wrong secret of enough length"), (3, None)):
        cfg = dict(rank=rank, out=str(swarm.tmp / f"peer{rank}.pt"), initial_peers=swarm.initial_peers,
                   inner="sgd", batch_size=8, target_batch_size=64, epochs=epochs, secret=secret)
        (swarm.tmp / f"stranger{rank}.json").write_text(json.dumps(cfg))
        stranger = run_tool([sys.executable, "tests/swarm/peer.py", str(swarm.tmp / f"stranger{rank}.json")], swarm)
        assert stranger.returncode != 0 and "bootstrap failed" in stranger.stdout + stranger.stderr
    # the monitor of someone without the secret is told why it sees nothing
    wrong = swarm.tmp / "wrong.secret"
    wrong.write_text("not the secret, but long enough")
    monitor = run_tool([sys.executable, "-m", "swarm_opt", "monitor", "--run-id", "test_run", "--once",
                        "--initial-peers", *swarm.initial_peers, "--run-secret-file", str(wrong)], swarm)
    assert monitor.returncode == 2, monitor.stderr
    assert "holds the run's credentials" in monitor.stderr and "not the secret" not in monitor.stderr + monitor.stdout
    monitor = run_tool([sys.executable, "-m", "swarm_opt", "monitor", "--run-id", "test_run", "--once",
                        "--initial-peers", *swarm.initial_peers], swarm)
    assert monitor.returncode == 2 and "pass its secret with --run-secret-file" in monitor.stderr, monitor.stderr
    # a member's monitor sees the two members and nobody else
    right = swarm.tmp / "right.secret"
    right.write_text(SECRET)
    monitor = run_tool([sys.executable, "-m", "swarm_opt", "monitor", "--run-id", "test_run", "--once",
                        "--initial-peers", *swarm.initial_peers, "--run-secret-file", str(right)], swarm)
    assert monitor.returncode == 0 and "peers 2" in monitor.stdout, monitor.stdout + monitor.stderr
    _served_page_shows_two_peers(swarm, right)
    # one who dials a member directly over libp2p and asks for its state gets nothing
    cfg = dict(initial_peers=swarm.initial_peers, run_id="test_run", out=str(swarm.tmp / "outsider.json"))
    (swarm.tmp / "outsider_cfg.json").write_text(json.dumps(cfg))
    outsider = run_tool([sys.executable, "tests/swarm/outsider.py", str(swarm.tmp / "outsider_cfg.json")], swarm)
    assert outsider.returncode == 0, outsider.stderr
    assert json.loads((swarm.tmp / "outsider.json").read_text())["received"] == 0

    for rank in range(2):  # the checks are done: the members may stop lingering as donors
        (swarm.tmp / f"peer{rank}.pt.stop").touch()
    swarm.wait(timeout=150)
    results = [swarm.result(rank) for rank in range(2)]
    for r in results:
        assert r["epoch"] >= epochs and all(rep["num_peers"] <= 2 for rep in r["reports"]), swarm.round_events()
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))
    logs = swarm.log(0) + swarm.log(1)
    assert "does not hold this private run's credentials" in logs
    assert "is not a member of this private run" in logs
    assert "Traceback" not in logs and SECRET not in logs


def _served_page_shows_two_peers(swarm, secret_file) -> None:
    """A member's ``monitor --serve`` reads the private run too: its page's JSON lists the two members."""
    page = subprocess.Popen([sys.executable, "-m", "swarm_opt", "monitor", "--run-id", "test_run", "--serve",
                             "127.0.0.1:0", "--initial-peers", *swarm.initial_peers, "--run-secret-file",
                             str(secret_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(REPO), env=testing.peer_env(), start_new_session=True)
    try:
        lines = []
        while not (found := re.search(r"on (http://127\.0\.0\.1:\d+/)", lines[-1] if lines else "")):
            lines.append(page.stderr.readline())
            assert lines[-1], "".join(lines)  # the monitor ended before serving
        url = found.group(1)
        deadline, seen = time.monotonic() + 30, {}
        while time.monotonic() < deadline and seen.get("num_peers") != 2:
            time.sleep(0.5)
            with urllib.request.urlopen(url + "api/run.json", timeout=10) as response:
                seen = json.loads(response.read())
        assert seen.get("status") == "live" and seen.get("num_peers") == 2 and len(seen["peers"]) == 2, seen
    finally:
        page.terminate()
        _, err = page.communicate(timeout=30)
    assert "Traceback" not in err and SECRET not in err, err


def test_members_with_the_secret_download_state_from_each_other(swarm):
    swarm.start(0, inner="sgd", batch_size=8, target_batch_size=64, epochs=3, secret=SECRET, max_seconds=120)
    swarm.start(1, inner="sgd", batch_size=8, target_batch_size=64, epochs=3, secret=SECRET, downloads=1,
                max_seconds=120)
    swarm.wait(timeout=150)
    assert "Loaded the swarm's state" in swarm.log(1), swarm.log(1)
    # at its first try: a newcomer publishes no progress record before it joined, and is admitted all the same
    assert "No peer ahead" not in swarm.log(1) and "Refused" not in swarm.log(0), swarm.log(0) + swarm.log(1)


def test_an_allowlist_admits_listed_identities_only(tmp_path):
    """Three DHT nodes hold the run's secret; the allowlist names the first two's persistent peer ids."""
    import hivemind
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils import get_dht_time

    from swarm_opt import PrivateRun

    paths = [str(tmp_path / f"id{i}") for i in range(3)]
    for path in paths:
        P2P.generate_identity(path)
    allowed = [PeerID.from_identity(open(p, "rb").read()).to_base58() for p in paths[:2]]

    def node(i: int, initial_peers=()):
        run = PrivateRun(secret=SECRET.encode(), allowed_peers=allowed, identity_path=paths[i])
        return hivemind.DHT(initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                            identity_path=paths[i], authorizer=run.authorizer(), start=True)

    first = node(0)
    try:
        second = node(1, [str(a) for a in first.get_visible_maddrs()])
        assert second.store("k", "listed", get_dht_time() + 30)
        assert first.get("k", latest=True).value == "listed"
        second.shutdown()
        with pytest.raises(Exception, match="bootstrap failed"):
            node(2, [str(a) for a in first.get_visible_maddrs()])
    finally:
        first.shutdown()
