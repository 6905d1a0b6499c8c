"""Does a swarm that runs for hours grow? A CLI swarm under churn, sampled for memory, descriptors, threads, processes.

The swarm is what a month-long run sees, compressed: a ``swarm-opt dht`` bootstrap node; ``--stable`` peers (3) that
run from start to end; one *churn* peer SIGKILLed and restarted every ``--kill-every`` seconds (its process group,
p2pd and all, as a power cut does); a *newcomer* now and then that joins, downloads the swarm's state, trains for
``--newcomer-life`` seconds and leaves with Ctrl-C; and failed rounds now and then: the churn peer is frozen
(SIGSTOP) for ``--stall-seconds``, longer than ``--averaging-timeout``, so that the rounds it is in fail (failed
rounds are where hivemind's averager leaked, hivemind #264). Peers train ``benchmarks/soak_task.py`` (digits with a
1.12M-parameter MLP: a buffer leaked per round would be 4.5 MB, not hidden in the noise) and checkpoint.

Every ``--sample-every`` seconds, for each stable peer's whole process tree (its session: trainer, DHT process,
p2pd, averager, torch's shm manager if any): PSS, USS and RSS from ``/proc/PID/smaps_rollup``, open file
descriptors, threads, processes; the peer's epoch and rounds by outcome (its Prometheus endpoint); the machine's
load average (other jobs share the cores, and the epoch rate moves with them). Samples go to
``OUT/samples.jsonl`` as they are taken, events (kills, stalls, newcomers) to ``OUT/events.jsonl``.

The verdict, after ``--warmup-minutes`` (counted from the moment every stable peer trains; the churn schedule and
``--minutes`` start then too): the least-squares slope of each peer's PSS (goal <= 5 MB/h), of its fds,
threads and processes (flat), and the swarm's epochs per minute in the last quarter against the first (>= 0.9x,
with the load in both quarters beside it).

    python benchmarks/soak.py --minutes 5 --warmup-minutes 1 --out /tmp/soak-try      # a try
    nohup python benchmarks/soak.py --minutes 150 --out /work/soak-run > /work/soak-run/soak.log 2>&1 &
    python benchmarks/soak.py --analyse /work/soak-run                                   # the verdict again
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from _common import REPO, table, write_json

from swarm_opt import testing
from swarm_opt._hivemind import memtrace
from swarm_opt.testing import name_roles, process_sample, session_members

MB = 1e6
TAG_VARIABLE = "SWARMOPT_SOAK_TAG"
TASK = f"{REPO / 'benchmarks' / 'soak_task.py'}:make_task"
GOAL_MB_PER_HOUR = 5.0
GOAL_RATE_RATIO = 0.9


def metrics(port: int) -> Dict[str, float]:
    """The peer's epoch and rounds by outcome, from its Prometheus endpoint ({} while it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except (OSError, ValueError):
        return {}
    found: Dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r'^(swarm_opt_epoch|swarm_opt_rounds_total(?:\{outcome="(\w+)"\})?) ([-\d.e+]+)$', line)
        if match:
            found[match.group(2) or "epoch"] = float(match.group(3))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the swarm -------------------------------------------------------------------------------------------------------

class Swarm:
    """Starts and stops the soak's CLI processes in ``out``; every one carries a tag, so nothing escapes ``close``."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.out, self.args = out, args
        self.tag = uuid.uuid4().hex
        self.env = {**{k: v for k, v in testing.peer_env(**{TAG_VARIABLE: self.tag}).items()
                       if not k.startswith("SWARM_OPT_")}, **dict(args.peer_env)}
        self.prefix = ["nice", "-n", str(args.nice)] if args.nice else []
        self.procs: List[subprocess.Popen] = []
        self.names: Dict[int, str] = {}  # pid -> the name of its logs
        self.maddr = ""
        self.events = open(out / "events.jsonl", "a")
        self.t0 = time.monotonic()

    def event(self, kind: str, **info) -> None:
        record = {"t": round(time.monotonic() - self.t0, 1), "wall": time.strftime("%H:%M:%S"), "event": kind, **info}
        self.events.write(json.dumps(record) + "\n")
        self.events.flush()
        print(f"[{record['wall']}] {kind} {info if info else ''}", flush=True)

    def start(self, name: str, *argv: str, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        """Start ``swarm-opt ARGV`` in a session of its own that dies with this driver, even of a SIGKILL:
        a soak that stops, however it stops, leaves no swarm behind."""
        proc = testing.start(["-m", "swarm_opt", *argv], log=self.out / f"{name}.out",
                             stderr_log=self.out / f"{name}.err", env={**self.env, **(env or {})}, cwd=self.out,
                             prefix=self.prefix)
        self.procs.append(proc)
        self.names[proc.pid] = name
        return proc

    def bootstrap(self) -> None:
        self.start("dht", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0")
        deadline = time.monotonic() + 90
        while not self.maddr:
            match = re.search(r"^(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)$", (self.out / "dht.out").read_text(), re.M)
            if match:
                self.maddr = match.group(1)
            elif time.monotonic() > deadline:
                raise RuntimeError(f"swarm-opt dht printed no address:\n{testing.tail(self.out / 'dht.err')}")
            time.sleep(0.2)

    def train(self, name: str, *extra: str, log_name: Optional[str] = None,
              env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        a = self.args
        return self.start(log_name or name, "train", "--run-id", "soak", "--initial-peers", self.maddr,
                          "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--task", a.task,
                          "--target-batch-size", str(a.target_batch_size),
                          "--matchmaking-time", str(a.matchmaking_time),
                          "--averaging-timeout", str(a.averaging_timeout), "--checkpoint-dir", f"ckpt-{name}",
                          "--checkpoint-every", str(a.checkpoint_every), *extra, env=env)

    def stop(self, proc: subprocess.Popen, how: int, grace: float = 60.0) -> Dict:
        """Stop one peer with ``how`` (SIGKILL, SIGINT) to its whole group; report its exit and any leftovers."""
        testing.signal_group(proc, how)
        try:
            code = proc.wait(grace)
        except subprocess.TimeoutExpired:
            code = None
        deadline = time.monotonic() + 15  # a DHT process outside the group dies with its parent (PDEATHSIG)
        while session_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [f"{p['pid']} {p['comm']}" for p in map(process_sample, session_members(proc.pid)) if p]
        testing.kill([proc])
        self.procs.remove(proc)
        report = {"exit": code, "leftovers": left}
        if left or code is None:  # what it was doing when asked to stop
            report["stderr_tail"] = testing.tail(self.out / f"{self.names[proc.pid]}.err", 5)
        return report

    def close(self) -> None:
        """Kill what is still running; record (event "left behind") anything of the soak's that outlived its
        peer's process group, and kill it too."""
        testing.kill(self.procs)
        deadline = time.monotonic() + 15  # DHT processes die with their parents (PDEATHSIG), a moment later
        while tagged(self.tag) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [p for p in map(process_sample, tagged(self.tag)) if p]
        if left:
            self.event("left behind", leftovers=[f"{p['pid']} {p['comm']}" for p in left])
        for p in left:
            try:
                os.kill(p["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.events.close()


def tracing(args: argparse.Namespace, out: Path, name: str) -> Dict[str, str]:
    """The environment that turns on a stable peer's averager memory trace (``--tracemalloc``, the first
    ``--trace-peers`` stable peers), else {}."""
    if not args.tracemalloc or (args.trace_peers and int(name.removeprefix("stable")) >= args.trace_peers):
        return {}
    return {memtrace.VARIABLE: str(out.resolve() / f"trace-{name}"),
            f"{memtrace.VARIABLE}_PERIOD": str(args.trace_every),
            f"{memtrace.VARIABLE}_WARMUP": str(args.warmup_minutes * 60)}


def tagged(tag: str) -> List[int]:
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def tracebacks(path: Path) -> int:
    try:
        return path.read_text(errors="replace").count("Traceback")
    except OSError:
        return 0


def soak(args: argparse.Namespace, out: Path) -> None:
    swarm = Swarm(out, args)
    samples = open(out / "samples.jsonl", "a")
    rng = random.Random(args.seed)
    (out / "config.json").write_text(json.dumps({**vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S")},
                                                default=str))
    try:
        swarm.bootstrap()
        ports = [free_port() for _ in range(args.stable)]
        stable = [swarm.train(f"stable{i}", "--data-seed", str(i), "--metrics-port", str(ports[i]),
                              env=tracing(args, out, f"stable{i}"))
                  for i in range(args.stable)]
        churn_round = 0
        churn = swarm.train("churn", "--data-seed", "100", log_name="churn-0")
        # the schedule (and the warm-up) starts once every stable peer trains: start-up takes minutes on a loaded
        # machine, and a soak of a few minutes must not spend them starting
        deadline = time.monotonic() + args.start_timeout
        while min(metrics(port).get("epoch", 0) for port in ports) < 1:
            for i, proc in enumerate(stable):
                if proc.poll() is not None:
                    raise RuntimeError(f"stable peer {i} exited ({proc.returncode}):\n"
                                       f"{testing.tail(out / f'stable{i}.err')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stable peers did not reach epoch 1 within {args.start_timeout:.0f} s")
            samples.write(json.dumps(sample(stable, ports, swarm)) + "\n")
            time.sleep(args.sample_every)
        swarm.event("training")
        newcomer: Optional[subprocess.Popen] = None
        newcomer_count, newcomer_since = 0, 0.0
        begin = time.monotonic()  # the schedule starts once the swarm is up (the samples' clock at the start)
        end = begin + args.minutes * 60
        next_sample = begin
        never = math.inf  # a schedule set to 0 (--kill-every 0: no churn) never comes
        next_kill = begin + args.kill_every if args.kill_every > 0 else never
        next_stall, thaw_at = (begin + args.stall_every if args.stall_every > 0 else never), None
        next_newcomer = begin + args.newcomer_every if args.newcomer_every > 0 else never
        swarm.event("started", maddr=swarm.maddr, stable=args.stable)
        while time.monotonic() < end:
            now = time.monotonic()
            for i, proc in enumerate(stable):
                if proc.poll() is not None:
                    raise RuntimeError(f"stable peer {i} exited ({proc.returncode}):\n"
                                       f"{testing.tail(out / f'stable{i}.err')}")
            if now >= next_kill:
                info = swarm.stop(churn, signal.SIGKILL, grace=10)
                churn_round += 1
                swarm.event("churn killed", round=churn_round, **info)
                churn = swarm.train("churn", "--data-seed", str(100 + churn_round), log_name=f"churn-{churn_round}")
                thaw_at = None  # a frozen peer dies frozen; its successor starts running
                next_stall = max(next_stall, now + args.stall_seconds)
                next_kill = now + args.kill_every * rng.uniform(0.8, 1.2)
            elif thaw_at is None and now >= next_stall and churn.poll() is None:
                testing.signal_group(churn, signal.SIGSTOP)
                swarm.event("churn frozen", seconds=args.stall_seconds)
                thaw_at = now + args.stall_seconds
            elif thaw_at is not None and now >= thaw_at:
                testing.signal_group(churn, signal.SIGCONT)
                swarm.event("churn thawed")
                thaw_at = None
                next_stall = now + args.stall_every * rng.uniform(0.8, 1.2) if args.stall_every > 0 else never
            if newcomer is None and now >= next_newcomer:
                newcomer_count += 1
                newcomer = swarm.train(f"newcomer{newcomer_count}", "--data-seed", str(1000 + newcomer_count))
                newcomer_since = now
                swarm.event("newcomer joined", n=newcomer_count)
            elif newcomer is not None and now - newcomer_since >= args.newcomer_life:
                name = f"newcomer{newcomer_count}"
                info = swarm.stop(newcomer, signal.SIGINT)
                swarm.event("newcomer left", n=newcomer_count, tracebacks=tracebacks(out / f"{name}.err"), **info)
                newcomer = None
                next_newcomer = now + args.newcomer_every
            if now >= next_sample:
                samples.write(json.dumps(sample(stable, ports, swarm)) + "\n")
                samples.flush()
                next_sample += args.sample_every
            time.sleep(0.5)
        for i, proc in enumerate(stable):
            info = swarm.stop(proc, signal.SIGINT)
            swarm.event("stable stopped", peer=i, tracebacks=tracebacks(out / f"stable{i}.err"), **info)
        swarm.event("finished")
    finally:
        samples.close()
        swarm.close()


def sample(stable: Sequence[subprocess.Popen], ports: Sequence[int], swarm: Swarm) -> Dict:
    peers = []
    for proc, port in zip(stable, ports):
        procs = [p for p in map(process_sample, session_members(proc.pid)) if p]
        name_roles(proc.pid, procs)
        peers.append({"procs": procs, **metrics(port)})
    return {"t": round(time.monotonic() - swarm.t0, 1), "wall": time.time(), "load": os.getloadavg(),
            "all_processes": len(tagged(swarm.tag)), "peers": peers}


# --- the verdict -----------------------------------------------------------------------------------------------------

def slope_per_hour(ts: Sequence[float], ys: Sequence[float]) -> tuple:
    """Least-squares slope (units per hour) and the residuals' standard deviation."""
    import numpy as np

    t = np.asarray(ts) / 3600.0
    y = np.asarray(ys, dtype=float)
    if len(t) < 3:
        return float("nan"), float("nan")
    a, b = np.polyfit(t, y, 1)
    return float(a), float(np.std(y - (a * t + b)))


def analyse(out: Path, warmup_minutes: float) -> Dict:
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines() if line.strip()]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    # the warm-up counts from the moment every stable peer trained (runs before that event: from the start)
    training = next((e["t"] for e in events if e["event"] == "training"), 0.0)
    after = [r for r in rows if r["t"] >= training + warmup_minutes * 60]
    if len(after) < 4:
        raise SystemExit(f"only {len(after)} samples after the warm-up: run longer or shorten --warmup-minutes")
    ts = [r["t"] for r in after]
    peers = []
    for i in range(len(after[0]["peers"])):
        series = {key: [sum(p[key] for p in r["peers"][i]["procs"]) for r in after]
                   for key in ("pss", "uss", "rss", "fds", "threads")}
        series["processes"] = [len(r["peers"][i]["procs"]) for r in after]
        peer = {"peer": i}
        for key, ys in series.items():
            scale = MB if key in ("pss", "uss", "rss") else 1.0
            slope, noise = slope_per_hour(ts, [y / scale for y in ys])
            quarter = max(1, len(ys) // 4)
            growth = (statistics.median(ys[-quarter:]) - statistics.median(ys[:quarter])) / scale
            peer[key] = {"first": ys[0] / scale, "last": ys[-1] / scale, "min": min(ys) / scale,
                         "max": max(ys) / scale, "slope_per_h": slope, "noise": noise, "growth": growth}
        roles = sorted({p["role"] for r in after for p in r["peers"][i]["procs"]})
        peer["pss_by_role"] = {}
        for role in roles:
            pts = [(r["t"], sum(p["pss"] for p in r["peers"][i]["procs"] if p["role"] == role) / MB) for r in after]
            slope, noise = slope_per_hour([t for t, _ in pts], [y for _, y in pts])
            peer["pss_by_role"][role] = {"first": pts[0][1], "last": pts[-1][1], "slope_per_h": slope}
        last = after[-1]["peers"][i]
        peer["rounds"] = {k: last.get(k) for k in ("committed", "failed", "downloaded", "skipped")}
        peers.append(peer)

    # the swarm's epoch rate: the highest epoch any stable peer reports, per quarter of the post-warm-up window
    span = ts[-1] - ts[0]
    quarters = []
    for q in range(4):
        lo, hi = ts[0] + q * span / 4, ts[0] + (q + 1) * span / 4
        inside = [r for r in after if lo <= r["t"] <= hi]  # none if sampling paused (a peer slow to stop)
        epochs = [max((p.get("epoch", 0) for p in r["peers"]), default=0) for r in inside]
        minutes = (inside[-1]["t"] - inside[0]["t"]) / 60 if inside else 0.0
        quarters.append({"from_min": lo / 60, "to_min": hi / 60,
                         "epochs_per_min": (epochs[-1] - epochs[0]) / minutes if minutes > 0 else float("nan"),
                         "load1_mean": sum(r["load"][0] for r in inside) / len(inside) if inside else float("nan")})
    everything = [r["all_processes"] for r in after if "all_processes" in r]
    counts: Dict[str, int] = {}
    for e in events:
        counts[e["event"]] = counts.get(e["event"], 0) + 1
    leftovers = [e for e in events if e.get("leftovers")]
    noisy = [e for e in events if e.get("tracebacks")]
    worst = max(p["pss"]["slope_per_h"] for p in peers)
    first, last = quarters[0]["epochs_per_min"], quarters[-1]["epochs_per_min"]
    ratio = last / first if first and math.isfinite(first) and math.isfinite(last) else None
    return {"hours": (rows[-1]["t"]) / 3600, "warmup_minutes": warmup_minutes, "samples": len(rows),
            "all_processes": [min(everything), max(everything)] if everything else None,
            "peers": peers, "quarters": quarters, "events": counts, "events_with_leftovers": leftovers,
            "events_with_tracebacks": noisy, "worst_pss_slope_mb_per_h": worst, "rate_ratio_last_first": ratio,
            "traces": traces(out),
            "verdict": {"memory": worst <= GOAL_MB_PER_HOUR,
                        "rate": ratio is not None and ratio >= GOAL_RATE_RATIO,
                        "clean": not leftovers and not noisy}}


def traces(out: Path) -> List[Dict]:
    """What each traced averager process (``--tracemalloc``) grew by after its baseline: slopes (MB/h) of its PSS,
    of what tracemalloc traced, of glibc's heap in use and free; the counts that changed; its top lines and object
    types by growth at its last sample."""
    found = []
    for path in sorted(out.glob("trace-*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if "top" in r]  # after the baseline
        if len(rows) < 3:
            continue
        ts = [r["t"] for r in rows]
        series = {"pss": [r["memory"].get("pss", 0) for r in rows], "traced": [r["traced"] for r in rows],
                  "heap_in_use": [r["heap"].get("in_use", 0) for r in rows],
                  "heap_free": [r["heap"].get("free", 0) for r in rows],
                  "tensors": [r.get("tensors", {}).get("bytes", 0) for r in rows]}
        slopes = {key: slope_per_hour(ts, [y / MB for y in ys])[0] for key, ys in series.items()}
        counts = {key: [rows[0]["counts"].get(key), rows[-1]["counts"].get(key)] for key in rows[-1]["counts"]}
        counts["tasks_total"] = [rows[0]["tasks_total"], rows[-1]["tasks_total"]]
        found.append({"file": path.name, "minutes": (ts[-1] - ts[0]) / 60, "mb_per_h": slopes,
                      "pss_mb": [series["pss"][0] / MB, series["pss"][-1] / MB],
                      "traced_mb": [series["traced"][0] / MB, series["traced"][-1] / MB],
                      "counts_changed": {k: v for k, v in counts.items() if v[0] != v[1]},
                      "top": rows[-1]["top"][:12], "types_grown": rows[-1]["types_grown"][:12],
                      "tasks": rows[-1]["tasks"]})
    return found


def report_traces(found: List[Dict]) -> None:
    if not found:
        return
    print()
    print(table(["averager trace", "minutes", "PSS MB", "PSS MB/h", "traced MB", "traced MB/h", "heap in use MB/h",
                 "heap free MB/h", "tensors MB/h"],
                [[t["file"], f"{t['minutes']:.0f}", f"{t['pss_mb'][0]:.0f} -> {t['pss_mb'][1]:.0f}",
                  f"{t['mb_per_h']['pss']:+.1f}", f"{t['traced_mb'][0]:.1f} -> {t['traced_mb'][1]:.1f}",
                  f"{t['mb_per_h']['traced']:+.1f}", f"{t['mb_per_h']['heap_in_use']:+.1f}",
                  f"{t['mb_per_h']['heap_free']:+.1f}", f"{t['mb_per_h']['tensors']:+.1f}"] for t in found]))
    for t in found:
        print(f"\n{t['file']}: counts that changed {t['counts_changed']}; object types grown "
              f"{[tuple(x[:2]) for x in t['types_grown'][:8]]}")
        for line in t["top"][:8]:
            print(f"  {line['kb']:+9.1f} kB {line['count']:+7d}  {' < '.join(line['where'])}")


def report(result: Dict) -> None:
    rows = []
    for p in result["peers"]:
        rows.append([p["peer"], f"{p['pss']['first']:.0f} -> {p['pss']['last']:.0f}",
                     f"{p['pss']['slope_per_h']:+.1f} (±{p['pss']['noise']:.1f})",
                     f"{p['uss']['slope_per_h']:+.1f}", f"{p['rss']['slope_per_h']:+.1f}",
                     f"{p['fds']['min']:.0f}-{p['fds']['max']:.0f} ({p['fds']['slope_per_h']:+.1f}/h)",
                     f"{p['threads']['min']:.0f}-{p['threads']['max']:.0f} ({p['threads']['slope_per_h']:+.1f}/h)",
                     f"{p['processes']['min']:.0f}-{p['processes']['max']:.0f}",
                     f"{p['rounds']['committed']:.0f}/{p['rounds']['failed']:.0f}" if p["rounds"]["committed"]
                     is not None else "?"])
    print(f"\nsoak: {result['hours']:.2f} h, {result['samples']} samples, warm-up {result['warmup_minutes']} min; "
          f"events {result['events']}; all the soak's processes {result.get('all_processes')} (min, max)\n")
    print(table(["peer", "PSS MB", "PSS MB/h (noise)", "USS MB/h", "RSS MB/h", "fds", "threads", "procs",
                 "rounds ok/failed"], rows))
    roles = sorted({r for p in result["peers"] for r in p["pss_by_role"]})
    print()
    print(table(["peer", *[f"{r} PSS MB (MB/h)" for r in roles]],
                [[p["peer"], *[f"{p['pss_by_role'][r]['last']:.0f} ({p['pss_by_role'][r]['slope_per_h']:+.1f})"
                               if r in p["pss_by_role"] else "-" for r in roles]] for p in result["peers"]]))
    print()
    print(table(["quarter", "minutes", "epochs/min", "load (1 min, mean)"],
                [[i + 1, f"{q['from_min']:.0f}-{q['to_min']:.0f}", f"{q['epochs_per_min']:.1f}",
                  f"{q['load1_mean']:.2f}"] for i, q in enumerate(result["quarters"])]))
    ratio = result["rate_ratio_last_first"]
    print(f"\nworst PSS slope {result['worst_pss_slope_mb_per_h']:+.1f} MB/h (goal <= {GOAL_MB_PER_HOUR}); "
          f"epochs/min last/first quarter {ratio if ratio is None else round(ratio, 2)} (goal >= {GOAL_RATE_RATIO}); "
          f"stops with leftovers {len(result['events_with_leftovers'])}, "
          f"with tracebacks {len(result['events_with_tracebacks'])}; verdict {result['verdict']}")
    report_traces(result.get("traces", []))


#: ``--diagnose``: the soak compressed into minutes, to find a memory growth quickly. Three peers at a high round
#: rate (small global batch, short matchmaking and averaging timeout); the churn peer SIGKILLed every 40 s and frozen
#: every 60 s for longer than the averaging timeout, so that rounds fail and peer ids come and go several times
#: faster than in the soak; the stable peers' averagers traced (``--tracemalloc``). Each option still overrides it.
DIAGNOSE = {"minutes": 15, "warmup_minutes": 3, "stable": 2, "kill_every": 40, "stall_every": 60, "stall_seconds": 10,
            "newcomer_every": 240, "newcomer_life": 60, "sample_every": 10, "target_batch_size": 256,
            "matchmaking_time": 0.5, "averaging_timeout": 6.0, "tracemalloc": True, "trace_every": 30}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    """SIGTERM, SIGHUP (unless ignored: ``nohup``) and SIGQUIT stop the swarm as cleanly as a Ctrl-C; a SIGKILL of
    this driver takes its peers down through the kernel (``Swarm.start``)."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _interrupt)


def _peer_env(text: str) -> tuple:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--peer-env takes KEY=VALUE, got {text!r}")
    return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=150)
    parser.add_argument("--warmup-minutes", type=float, default=15)
    parser.add_argument("--out", type=Path, default=Path("/tmp/swarm_opt_soak"))
    parser.add_argument("--analyse", type=Path, metavar="OUT", help="only print the verdict of a finished run")
    parser.add_argument("--stable", type=int, default=3)
    parser.add_argument("--kill-every", type=float, default=90, help="seconds between SIGKILLs of the churn peer")
    parser.add_argument("--stall-every", type=float, default=300, help="seconds between freezes of the churn peer")
    parser.add_argument("--stall-seconds", type=float, default=25)
    parser.add_argument("--newcomer-every", type=float, default=600)
    parser.add_argument("--newcomer-life", type=float, default=120)
    parser.add_argument("--sample-every", type=float, default=30)
    parser.add_argument("--start-timeout", type=float, default=900, help="seconds for the stable peers to train")
    parser.add_argument("--task", default=TASK)
    parser.add_argument("--target-batch-size", type=int, default=1024)
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--averaging-timeout", type=float, default=15.0)
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--nice", type=int, default=0, help="run the peers under nice -n N (a shared machine)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jitter of kills and freezes")
    parser.add_argument("--tag", default="", help="suffix of the result file: results/soak{TAG}.json")
    parser.add_argument("--json", type=Path, help="write the result here instead (a test reads it)")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="trace the stable peers' averager processes (OUT/trace-*.jsonl; swarm_opt._hivemind."
                             "memtrace): which lines, structures and object types grow")
    parser.add_argument("--trace-every", type=float, default=60, help="seconds between two traced samples")
    parser.add_argument("--trace-peers", type=int, default=0,
                        help="trace only the first N stable peers (0: all), the others' slopes free of the tracing")
    parser.add_argument("--peer-env", type=_peer_env, action="append", default=[], metavar="KEY=VALUE",
                        help="set in every peer's environment (MALLOC_ARENA_MAX=2, SWARM_OPT_MALLOC_TRIM=1...)")
    parser.add_argument("--diagnose", action="store_true",
                        help=f"a quick high-rate run with traced averagers: {DIAGNOSE} unless given")
    if "--diagnose" in sys.argv[1:]:
        parser.set_defaults(**DIAGNOSE)
    args = parser.parse_args()
    if args.analyse:
        config = json.loads((args.analyse / "config.json").read_text())
        result = analyse(args.analyse, config["warmup_minutes"])
        report(result)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("samples.jsonl", "events.jsonl"):
        (args.out / name).unlink(missing_ok=True)
    failure = None
    _stop_on_signals()
    try:
        soak(args, args.out)
    except (RuntimeError, KeyboardInterrupt) as e:  # what was sampled until then is still worth a verdict
        failure = f"{type(e).__name__}: {e}"
        print(f"soak stopped early: {failure}", file=sys.stderr)
    result = analyse(args.out, args.warmup_minutes)
    report(result)
    payload = {"config": {k: str(v) for k, v in vars(args).items()}, "failure": failure, **result}
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2, default=str))
        path = args.json
    else:
        path = write_json(f"soak{args.tag}.json", payload)
    print(f"\nwrote {path}")
    sys.exit(0 if failure is None and all(result["verdict"].values()) else 1)


if __name__ == "__main__":
    main()
