"""A live web page of a run (``swarm-opt monitor --serve [HOST:]PORT``), from the standard library alone.

One ``RunMonitor`` reads the run from the DHT about once a second (``serve_forever``); the HTTP server only hands
out the last snapshot, so any number of browsers cost the DHT nothing more. The page is one self-contained HTML file
(``page.html``: inline script, inline SVG charts; no CDN, works offline) that polls ``/api/run.json`` every second.
Served by ``http.server.ThreadingHTTPServer``: enough for the handful of people watching a run; put a reverse proxy
in front to publish it.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from swarm_opt.errors import ConfigError
from swarm_opt.monitor.reader import PeerView, RunHistory, RunMonitor, RunSnapshot

logger = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0  # how often the one reader reads the DHT (the page is at most about 2 s behind it)


def _finite(value: Optional[float]) -> Optional[float]:
    return None if value is None or not math.isfinite(value) else float(value)


def _peer_json(peer: PeerView) -> Dict[str, Any]:
    stats = peer.stats
    return {"id": peer.peer_id, "role": peer.role, "epoch": peer.epoch, "samples": peer.samples,
            "samples_per_second": _finite(peer.samples_per_second), "last_seen": round(peer.last_seen, 1),
            "ignored": peer.ignored, "loss": None if stats is None else stats.loss,
            "rounds": {} if stats is None else dict(stats.rounds),
            "version": None if stats is None else stats.swarm_opt_version}


def snapshot_json(run_id: str, snapshot: Optional[RunSnapshot], history: RunHistory, *, error: str = "") -> dict:
    """What ``/api/run.json`` returns: the last snapshot and the histories the charts draw."""
    if snapshot is None:
        return {"run_id": run_id, "status": "connecting", "error": error, "updated": time.time()}
    eta = snapshot.eta_seconds
    return {
        "run_id": run_id, "status": "live" if snapshot.peers else "empty", "error": error, "updated": time.time(),
        "epoch": snapshot.epoch, "num_peers": snapshot.num_peers, "num_clients": snapshot.num_clients,
        "samples_per_second": _finite(snapshot.samples_per_second),
        "samples_accumulated": snapshot.samples_accumulated, "target_batch_size": snapshot.target_batch_size,
        "eta_seconds": _finite(eta), "eta_unknown": eta is not None and math.isinf(eta),
        "peers": [_peer_json(p) for p in snapshot.peers + snapshot.helpers + snapshot.ignored],
        "history": {"epochs": [[round(t, 1), round(e, 3), n] for t, e, n in history.epochs],
                    "loss": [[e, v] for e, v in history.mean_loss()],
                    "rounds": [list(r) for r in history.rounds],
                    "traffic": [[round(t, 1), s, r] for t, s, r in history.traffic]},
        # None while no peer publishes its traffic: the page says so instead of drawing zeros
        "bytes_per_second": dict(zip(("sent", "received"), history.bytes_per_second()))
        if history.publishes_traffic else None,
    }


class MonitorPage:
    """The HTTP side: serves the page and the last JSON snapshot (``update``). Binds at construction: a port in use
    raises ``ConfigError`` naming it, before anything else starts."""

    def __init__(self, host: str, port: int, run_id: str) -> None:
        self.run_id = run_id
        self._lock = threading.Lock()
        self._json = json.dumps(snapshot_json(run_id, None, RunHistory())).encode()
        run_literal = json.dumps(run_id).replace("<", "\\u003c")  # safe inside <script> (run ids are plain anyway)
        page = (Path(__file__).parent / "page.html").read_text().replace("__RUN_ID__", run_literal).encode()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "swarm-opt-monitor"

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                if path in ("/", "/index.html"):
                    self._send(page, "text/html; charset=utf-8")
                elif path == "/api/run.json":
                    with owner._lock:
                        body = owner._json
                    self._send(body, "application/json")
                else:
                    self.send_error(HTTPStatus.NOT_FOUND, "the page is at / and its data at /api/run.json")

            def _send(self, body: bytes, content_type: str) -> None:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the browser went away
                    pass

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                logger.debug("%s %s", self.address_string(), format % args)

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise ConfigError(f"--serve {host}:{port}: cannot listen there ({e.strerror or e}); choose another port "
                              f"(or 0 for any free one)") from None
        self._server.daemon_threads = True
        self.address: Tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="swarm_opt.MonitorPage", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}/"

    def update(self, snapshot: Optional[RunSnapshot], history: RunHistory, error: str = "") -> None:
        body = json.dumps(snapshot_json(self.run_id, snapshot, history, error=error)).encode()
        with self._lock:
            self._json = body

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve_forever(monitor: RunMonitor, page: MonitorPage, stop: threading.Event) -> None:
    """Read the run every ``REFRESH_SECONDS`` and publish each snapshot to ``page`` until ``stop`` is set; a failed
    read keeps the last snapshot and shows the error."""
    snapshot: Optional[RunSnapshot] = None
    while not stop.is_set():
        began = time.monotonic()
        error = ""
        try:
            snapshot = monitor.read(timeout=5.0)
        except Exception as e:  # the page says what went wrong and keeps the last snapshot
            error = f"{type(e).__name__}: {e}"
            logger.debug("Could not read the run", exc_info=True)
        page.update(snapshot, monitor.run_history, error)
        stop.wait(max(0.0, REFRESH_SECONDS - (time.monotonic() - began)))
