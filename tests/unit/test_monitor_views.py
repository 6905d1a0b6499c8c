"""The views of a run and of a peer without a swarm: the web page's server and JSON, Prometheus metrics, TensorBoard
scalars, the peers' statistics record, and the observer the core calls (swarm_opt.metrics)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from swarm_opt import ConfigError, TrustConfig
from swarm_opt.metrics import NO_METRICS, Metrics
from swarm_opt.monitor import RunHistory, snapshot_from_records
from swarm_opt.monitor.stats import PeerStats
from swarm_opt.progress import ProgressRecord
from swarm_opt.trust import ClaimChecker


def record(name: str, epoch: int, samples: int = 10, client: bool = False) -> ProgressRecord:
    return ProgressRecord(peer_id=name.encode(), instance=name, epoch=epoch, samples=samples,
                          samples_per_second=50.0, time=100.0, client_mode=client, model_schema="s",
                          target_batch_size=256)


def stats(name: str, epoch: int, loss: float, committed: int, failed: int = 0, role: str = "trainer") -> PeerStats:
    return PeerStats(peer_id=name.encode(), time=100.0, role=role, epoch=epoch, loss=loss,
                     rounds={"committed": committed, "failed": failed}, swarm_opt_version="1.0")


def get(url: str) -> tuple:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers.get("Content-Type"), response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read()


class _Recorder(Metrics):
    def __init__(self) -> None:
        self.events: list = []

    def round_concluded(self, outcome: str, seconds: float, group_size: int) -> None:
        self.events.append(("round", outcome, group_size))

    def record_refused(self, reason: str, peer_id: bytes, why: str, seconds: float) -> None:
        self.events.append(("refused", reason, peer_id))


def test_the_default_observer_does_nothing_and_observers_join():
    assert NO_METRICS.joined(NO_METRICS) is NO_METRICS
    a, b = _Recorder(), _Recorder()
    assert NO_METRICS.joined(a) is a
    both = a.joined(b)
    both.round_concluded("committed", 1.0, 3)
    assert a.events == b.events == [("round", "committed", 3)]


def test_trust_tells_its_observer_who_it_ignores_and_why():
    checker = ClaimChecker(TrustConfig(ahead_grace=5.0, ignore_seconds=60.0))
    checker.metrics = seen = _Recorder()
    honest = [record("a", 5), record("b", 5)]
    checker.check(honest + [record("liar", 1005)], None, 100.0, 256)
    assert seen.events == []  # within its grace
    checker.check(honest + [record("liar", 1005)], None, 106.0, 256)
    assert seen.events == [("refused", "epoch_ahead", b"liar")]


def test_rounds_per_minute_count_what_peers_did_since_the_monitor_started():
    history = RunHistory()
    history.add_stats({b"a": stats("a", 3, 0.9, committed=3)}, now=600.0)  # before we watched: not counted
    history.add_stats({b"a": stats("a", 4, 0.7, committed=4, failed=1), b"b": stats("b", 4, 0.5, committed=9)},
                      now=610.0)
    history.add_stats({b"a": stats("a", 5, 0.6, committed=5), b"b": stats("b", 5, 0.4, committed=10)}, now=670.0)
    assert [list(r) for r in history.rounds] == [[10, 1, 1], [11, 2, 0]]
    assert history.mean_loss() == [(3, 0.9), (4, pytest.approx(0.6)), (5, pytest.approx(0.5))]


def test_bytes_per_second_sum_the_peers_that_publish_their_traffic():
    history = RunHistory()

    def traffic(name: str, t: float, sent: int, received: int) -> PeerStats:
        return PeerStats(peer_id=name.encode(), time=t, role="trainer", epoch=1, bytes_sent=sent,
                         bytes_received=received)

    history.add_stats({b"a": stats("a", 1, 0.5, 0)}, now=0.0)  # publishes no traffic
    assert not history.publishes_traffic
    history.add_stats({b"a": traffic("a", 100.0, 1000, 2000), b"b": traffic("b", 100.0, 0, 0)}, now=0.0)
    history.add_stats({b"a": traffic("a", 110.0, 3000, 3000), b"b": traffic("b", 105.0, 500, 100)}, now=0.0)
    assert history.publishes_traffic and history.bytes_per_second() == (200.0 + 100.0, 100.0 + 20.0)
    history.add_stats({b"a": traffic("a", 110.0, 3000, 3000)}, now=0.0)  # b left: its rate goes with it
    assert history.bytes_per_second() == (200.0, 100.0)


def test_the_page_serves_an_empty_state_then_snapshots_and_refuses_a_port_in_use():
    from swarm_opt.monitor.web import MonitorPage

    page = MonitorPage("127.0.0.1", 0, run_id="r1")
    try:
        status, kind, body = get(page.url)
        assert status == 200 and kind.startswith("text/html") and b"swarm-opt monitor" in body
        assert b"https://" not in body and b"http://" not in body  # nothing from the internet: works offline
        status, kind, body = get(page.url + "api/run.json")
        assert status == 200 and json.loads(body)["status"] == "connecting"
        assert get(page.url + "nothing")[0] == 404

        history = RunHistory()
        history.epochs.append((1.0, 2.5, 2))
        empty = snapshot_from_records("r1", [], 100.0)
        page.update(empty, history)
        assert json.loads(get(page.url + "api/run.json")[2])["status"] == "empty"
        snapshot = snapshot_from_records("r1", [record("a", 2, 100), record("b", 2, 28, client=True)], 101.0)
        page.update(snapshot, history)
        data = json.loads(get(page.url + "api/run.json")[2])
        assert (data["status"], data["epoch"], data["num_peers"], data["num_clients"]) == ("live", 2, 2, 1)
        assert data["samples_accumulated"] == 128 and data["target_batch_size"] == 256
        assert {p["role"] for p in data["peers"]} == {"trainer", "client"}
        assert data["history"]["epochs"] == [[1.0, 2.5, 2]]

        with pytest.raises(ConfigError, match=r"--serve 127\.0\.0\.1:\d+: cannot listen there"):
            MonitorPage("127.0.0.1", page.address[1], run_id="r1")
    finally:
        page.close()


def _free_port_in_use() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_prometheus_metrics_count_events_and_read_the_peer_when_scraped():
    pytest.importorskip("prometheus_client")
    from swarm_opt.monitor.prometheus import PrometheusMetrics

    uploads = SimpleNamespace(served=3, declined=1, most=1)
    peer = SimpleNamespace(local_epoch=7, progress=SimpleNamespace(num_peers=3, samples_per_second=123.0),
                           _averager=SimpleNamespace(uploads=uploads, _engine=SimpleNamespace(pid=None)))
    metrics = PrometheusMetrics(peer)
    port = metrics.serve(0, "127.0.0.1")
    try:
        metrics.round_concluded("committed", 0.7, 3)
        metrics.round_concluded("committed", 1.5, 3)
        metrics.round_concluded("failed", 30.0, 0)
        metrics.round_concluded("downloaded", 0.0, 0)
        metrics.record_refused("epoch_ahead", b"x", "far ahead", 60.0)
        status, _, body = get(f"http://127.0.0.1:{port}/metrics")
        text = body.decode()
        assert status == 200
        for line in ['swarm_opt_rounds_total{outcome="committed"} 2.0', 'swarm_opt_rounds_total{outcome="failed"} 1.0',
                     'swarm_opt_rounds_total{outcome="downloaded"} 1.0',
                     'swarm_opt_rounds_total{outcome="skipped"} 0.0',
                     'swarm_opt_round_seconds_count{outcome="committed"} 2.0',
                     'swarm_opt_records_refused_total{reason="epoch_ahead"} 1.0',
                     'swarm_opt_records_refused_total{reason="implausible_samples"} 0.0',
                     "swarm_opt_epoch 7.0", "swarm_opt_peers 3.0", "swarm_opt_samples_per_second 123.0",
                     "swarm_opt_state_downloads_served_total 3.0", "swarm_opt_state_downloads_declined_total 1.0"]:
            assert line in text, line
        assert "process_resident_memory_bytes" in text
        busy = _free_port_in_use()
        try:
            with pytest.raises(ConfigError, match="cannot listen on 127.0.0.1"):
                PrometheusMetrics().serve(busy.getsockname()[1], "127.0.0.1")
        finally:
            busy.close()
    finally:
        metrics.close()


def test_tensorboard_scalars_per_epoch_and_an_unwritable_directory(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from swarm_opt.monitor.tensorboard import TensorBoardLog

    board = TensorBoardLog(str(tmp_path / "tb"))
    for epoch in (1, 2):
        opt = SimpleNamespace(local_epoch=epoch, grad_norm=None,
                              progress=SimpleNamespace(num_peers=2, samples_per_second=100.0 * epoch, epsilon=None),
                              last_round=SimpleNamespace(epoch=epoch, seconds=0.5, group_size=2))
        board.log_epoch(opt, loss=1.0 / epoch, test_metrics={"accuracy": 0.5 + 0.1 * epoch})
    board.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "test/accuracy", "swarm/epoch", "swarm/peers", "swarm/samples_per_second",
            "swarm/round_seconds", "swarm/group_size"} <= tags
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 0.5)]
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="--log-dir .*: cannot write there"):
        TensorBoardLog(str(blocker / "tb"))


def test_tensorboard_tags_match_the_lightning_callback():
    import re
    from pathlib import Path

    import swarm_opt
    from swarm_opt.monitor.tensorboard import TAGS

    source = (Path(swarm_opt.__file__).parent / "lightning.py").read_text()  # (importing Lightning takes seconds)
    logged = set(re.findall(r'log\("(swarm/\w+)"', source))
    assert logged and logged <= set(TAGS)


def test_the_monitor_lists_who_trust_ignores_until_the_suspension_ends(monkeypatch):
    from swarm_opt.monitor import reader

    clock = [1000.0]
    monkeypatch.setattr(reader.time, "monotonic", lambda: clock[0])
    refusals = reader._Refusals()
    refusals.record_refused("epoch_ahead", b"liar", "it claims epoch 1005 while the swarm is at 5", 60.0)
    assert refusals.current() == {b"liar": "it claims epoch 1005 while the swarm is at 5"}
    clock[0] += 61.0
    assert refusals.current() == {}


def test_the_monitor_lists_a_peer_one_epoch_ahead_without_counting_it_in_the_epoch(monkeypatch):
    """At an epoch's end the peer that committed first stands one epoch ahead of the others' records for a moment:
    live, so listed (and counted in the swarm's size, as a trainer's tracker counts it), but not in the epoch."""
    from swarm_opt.monitor import reader

    records = [record("a", 5, 100), record("b", 5, 60), record("c", 6, 0, client=True)]
    sample = SimpleNamespace(scale=1.0, observe=lambda n: None)
    fake = SimpleNamespace(read=lambda timeout: (records, []), sample=sample, max_extrapolation=0.0)
    monkeypatch.setattr(reader, "use_progress_records", lambda dht, run_id: None)
    monkeypatch.setattr(reader, "SampledRecords", lambda *args, **kwargs: fake)
    snapshot = reader.RunMonitor(None, "r1", target_batch_size=256).read()
    assert snapshot.epoch == 5 and snapshot.samples_accumulated == 160
    assert {p.peer_id for p in snapshot.peers} >= {reader._peer_name(r) for r in records}
    assert snapshot.num_peers == 3 and snapshot.num_clients == 1
