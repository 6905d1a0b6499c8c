"""The monitor's web page in a real browser (headless chromium) against a real 3-peer run, Prometheus metrics scraped
from a live peer and checked against its log, and TensorBoard scalars written by ``train --log-dir``.

Set ``SWARM_OPT_MONITOR_SCREENSHOT=docs/monitor.png`` to also save the page as the documentation's screenshot.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from typing import Optional

import pytest

from tests.e2e.conftest import REPO
from tests.e2e.test_cli_swarm import train_args

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def chromium() -> Optional[str]:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def browse(url: str, *extra: str) -> subprocess.CompletedProcess:
    """Open ``url`` in a fresh headless chromium and let its script poll for about 3 s of virtual time."""
    with tempfile.TemporaryDirectory(prefix="swarm_opt_chromium_") as profile:
        return subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                               "--virtual-time-budget=3000", *extra, url],
                              capture_output=True, text=True, timeout=90)


def page_dom(url: str) -> str:
    result = browse(url, "--dump-dom")
    assert result.returncode == 0 and "<body" in result.stdout, result.stderr[-2000:]
    refreshes = int(re.search(r'<body data-refreshes="(\d+)"', result.stdout).group(1))
    assert refreshes >= 2, "the page did not poll /api/run.json by itself"
    return result.stdout


def shown(dom: str) -> tuple:
    """(epoch, peers, peer ids in the table) as the browser rendered them."""
    epoch = re.search(r'id="epoch">([^<]*)<', dom).group(1)
    peers = re.search(r'id="peers">([^<]*)<', dom).group(1)
    return (int(epoch) if epoch.isdigit() else None, int(peers) if peers.isdigit() else None,
            set(re.findall(r'<tr class="peer" data-peer="(\w+)"', dom)))


def peer_id(process) -> str:
    return process.wait_for(r"as peer (\w+) ", 90, stream="stderr").group(1)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([\d.e+-]+)$", text, re.MULTILINE)
    assert found, f"{name} not in the scrape:\n{text}"
    return float(found.group(1))


@pytest.mark.swarm
@pytest.mark.timeout(420)
def test_the_web_page_follows_a_live_run_in_a_real_browser(cli):
    if chromium() is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs it where apt-get and root are available)")
    _, maddr = cli.dht()
    server = cli.start("page", "monitor", "--run-id", "e2e_web", "--initial-peers", maddr, "--serve", "127.0.0.1:0")
    url = server.wait_for(r"on (http://127\.0\.0\.1:\d+/)", 60, stream="stderr").group(1)

    # opened before any peer published: an empty state, not an error
    dom = page_dom(url)
    assert "has published yet" in dom and shown(dom)[0] is None, dom[-3000:]

    # epochs of a few seconds (digits runs at ~10^5 samples/s), so that two reads a few seconds apart can agree
    common = train_args("e2e_web", maddr, "--target-batch-size", "500000", "--min-peers", "3")
    peers = [cli.start("peer0", *common), cli.start("peer1", *common, "--data-seed", "1"),
             cli.start("peer2", *common, "--data-seed", "2", "--client-mode")]
    ids = [peer_id(p) for p in peers]
    for p in peers:
        p.wait_for(r"^epoch 2: ", 200)

    once = cli.run("monitor", "--run-id", "e2e_web", "--initial-peers", maddr, "--once")
    assert once.returncode == 0, once.stderr
    head = re.search(r"^run e2e_web: epoch (\d+), peers (\d+) \((\d+) in client mode\)", once.stdout, re.MULTILINE)
    once_epoch, once_peers = int(head.group(1)), int(head.group(2))
    epoch, num_peers, rows = shown(page_dom(url))
    assert num_peers == once_peers == 3 and rows == set(ids), (num_peers, once.stdout, rows, ids)
    assert once_epoch <= epoch <= once_epoch + 2, (epoch, once.stdout)  # the run may move on between the two reads

    # the next epoch shows up without reloading anything but the page's own polling
    peers[0].wait_for(rf"^epoch {epoch + 1}: ", 120)
    time.sleep(2.0)  # the page is at most ~2 s behind the DHT
    dom = page_dom(url)  # (a peer one epoch ahead of the others' records, as at an epoch's end, is listed too)
    assert shown(dom)[0] >= epoch + 1, dom[-3000:]
    assert re.search(r'<span class="tag client">client</span>', dom)
    assert re.search(r'class="num">\d+\.\d+</td>', dom), "no peer's training loss is shown"  # from the stats record
    assert "<polyline" in dom  # the epochs chart has a line
    assert re.search(r'id="bytes"[^>]*>sent [\d.,]+ k?M?B/s, received', dom), "no traffic is shown"

    shot = os.environ.get("SWARM_OPT_MONITOR_SCREENSHOT")
    if shot:
        result = browse(url, "--window-size=1100,900", f"--screenshot={(REPO / shot).resolve()}")
        assert result.returncode == 0, result.stderr[-2000:]

    # a peer leaves (Ctrl-C): it withdraws its records and the page lists the two others
    peers[1].interrupt()
    assert peers[1].wait(60) == 0, peers[1].describe()
    deadline = time.monotonic() + 30
    while True:
        epoch, num_peers, rows = shown(page_dom(url))
        if (num_peers, rows) == (2, {ids[0], ids[2]}) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert (num_peers, rows) == (2, {ids[0], ids[2]}), (num_peers, rows, ids)

    for p in (peers[0], peers[2], server):
        p.interrupt()
    assert server.wait(30) == 0, server.describe()
    assert "Traceback" not in server.stderr, server.describe()


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_metrics_of_a_live_peer_match_its_log_and_tensorboard_gets_one_point_per_epoch(cli):
    pytest.importorskip("prometheus_client")
    pytest.importorskip("tensorboard")
    _, maddr = cli.dht()
    common = train_args("e2e_metrics", maddr, "--target-batch-size", "1024", "--min-peers", "2")
    watched = cli.start("peer0", *common, "--metrics-port", "127.0.0.1:0", "--log-dir", "tb")
    other = cli.start("peer1", *common, "--data-seed", "1")
    url = watched.wait_for(r"Prometheus metrics on (http://127\.0\.0\.1:\d+/metrics)", 90, stream="stderr").group(1)
    watched.wait_for(r"^epoch 3: ", 200)

    def outcomes() -> tuple:
        log = watched.stdout
        epochs = [int(e) for e in re.findall(r"^epoch (\d+): ", log, re.MULTILINE)]
        return (len(re.findall(r"^epoch \d+: .*averaged with", log, re.MULTILINE)),
                len(re.findall(r"^epoch \d+: .*caught up by downloading", log, re.MULTILINE)), epochs[-1])

    before = outcomes()
    text = scrape(url)
    after = outcomes()
    committed = metric(text, 'swarm_opt_rounds_total{outcome="committed"}')
    downloaded = metric(text, 'swarm_opt_rounds_total{outcome="downloaded"}')
    # a round is counted when it concludes, its log line follows the evaluation: at most one ahead of the log
    assert before[0] <= committed <= after[0] + 1, (before, after, text)
    assert before[1] <= downloaded <= after[1] + 1, (before, after, text)
    assert before[2] <= metric(text, "swarm_opt_epoch") <= after[2] + 1
    assert committed >= 1 and metric(text, "swarm_opt_peers") == 2
    assert metric(text, 'swarm_opt_round_seconds_count{outcome="committed"}') == committed
    assert metric(text, "swarm_opt_samples_per_second") > 0
    # digits' model is 1,210 float32 values: each committed round sends and receives at least a part of them
    assert metric(text, "swarm_opt_bytes_sent_total") > 0 and metric(text, "swarm_opt_bytes_received_total") > 0
    assert metric(text, "process_resident_memory_bytes") > 50e6  # the trainer (torch is loaded)
    assert metric(text, "swarm_opt_averager_resident_memory_bytes") > 1e6
    assert metric(text, "swarm_opt_dht_resident_memory_bytes") > 1e6
    for name in ("swarm_opt_state_downloads_served_total", "swarm_opt_state_downloads_declined_total",
                 'swarm_opt_records_refused_total{reason="epoch_ahead"}', 'swarm_opt_rounds_total{outcome="failed"}'):
        metric(text, name)

    for p in (watched, other):
        p.interrupt()
    assert watched.wait(60) == 0, watched.describe()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cli.workdir / "tb"))
    events.Reload()
    logged = [int(e.step) for e in events.Scalars("swarm/epoch")]
    printed = [int(e) for e in re.findall(r"^epoch (\d+): ", watched.stdout, re.MULTILINE)]
    assert logged == printed and len(printed) >= 3, (logged, printed)
    assert {"train/loss", "test/accuracy", "test/loss", "swarm/peers", "swarm/samples_per_second",
            "swarm/round_seconds", "swarm/group_size"} <= set(events.Tags()["scalars"])


@pytest.mark.timeout(120)
def test_a_busy_port_or_an_unwritable_log_dir_is_one_line(cli, tmp_path):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    try:
        for args, expected in [
            (["monitor", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmNothing", "--serve",
              str(port)], f"--serve 127.0.0.1:{port}: cannot listen there"),
            (["train", "--run-id", "r", "--metrics-port", str(port)], f"--metrics-port {port}: cannot listen on"),
            (["train", "--run-id", "r", "--log-dir", str(blocker / "tb")], "cannot write there"),
            (["dht", "--metrics-port", f"127.0.0.1:{port}"], "cannot listen on 127.0.0.1"),
        ]:
            result = cli.run(*args, timeout=90)
            assert result.returncode == 2, (args, result.stderr)
            assert expected in result.stderr and result.stderr.count("\n") == 1, (args, result.stderr)
    finally:
        busy.close()
