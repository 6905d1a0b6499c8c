"""Where the wall time of one swarm_opt all-reduce goes: CPU per process and a py-spy profile of the Python ones.

Runs ``benchmarks/allreduce.py --trace`` (one size, one peer count) and, while it runs:

* samples ``/proc/<pid>/stat`` (user + system CPU) of every process of every peer every 20 ms: the peer's own
  (user) process, its DHT process, its p2pd daemon (Go) and its averager process (hivemind forks one per
  ``TensorAverager``); the CPU each used inside the timed all-reduce windows is interpolated from these samples;
* records each averager with ``py-spy record --gil --format raw`` and sorts the samples into the stages of
  hivemind's butterfly all-reduce by the frame (function and line) they stand in. Only samples of the thread holding
  the GIL are kept: py-spy's idle detection lets many samples of idle threads through here, and the GIL is what
  serialises the averager's Python work anyway. Torch maths releases the GIL, so the reducer's sums and the final
  ``cat``/``add_`` are under-counted (they cost a few ms per 10M values); the per-thread CPU from ``/proc`` is exact;
* records each user process with plain ``py-spy record`` (for the finiteness scans and the copy into the buffer).

Outside the timed windows the averager only runs matchmaking (sorted into its own row) and the user process runs
gloo and the benchmark's bookkeeping (left out). Sampling pauses the profiled processes briefly and takes CPU of its
own on a small machine: take the timings from ``allreduce.py`` run alone and this script's shares, not its absolute
times.

    python benchmarks/profile_allreduce.py --peers 2 --size 1e7 --reps 15
    python benchmarks/profile_allreduce.py --peers 4 --size 1e7 --reps 10 --no-spy    # CPU only, undisturbed
    python benchmarks/profile_allreduce.py --peers 4 --size 1e7 --reps 10 -- --engine-opt part_size_bytes=4194304
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from _common import REPO, RESULTS_DIR, command_line, table, write_json

TICK = os.sysconf("SC_CLK_TCK")
BENCH = Path(__file__).with_name("allreduce.py")

# (category, predicate on one frame "function (file:line)"), tested from the innermost frame outwards; first wins
AVERAGER_RULES: List[Tuple[str, Sequence[str]]] = [
    ("finiteness check in codec (swarm_opt NoCompression)", ["_check_finite (swarm_opt/compression/codecs.py"]),
    ("encode part: tensor -> bytes -> pb Tensor (NoCompression.compress)", ["compress (hivemind/compression/base.py"]),
    ("decode part: pb bytes -> bytearray -> tensor (extract)", ["extract (hivemind/compression/base.py",
                                                             "deserialize_torch_tensor"]),
    ("pb message build, copies the part (AveragingData(...))", [f"_generate_input_for_peer (hivemind/averaging/"
                                                               f"allreduce.py:{n})" for n in range(250, 258)]
     + ["_accumulate_parts_streaming (hivemind/averaging/allreduce.py:356"]),
    ("pb SerializeToString", ["send_protobuf (hivemind/p2p/p2p_daemon.py:392"]),
    ("unix socket write to p2pd", ["send_raw_data ("]),
    ("pb ParseFromString", ["receive_protobuf (hivemind/p2p/p2p_daemon.py:401",
                            "receive_protobuf (hivemind/p2p/p2p_daemon.py:405"]),
    ("unix socket read from p2pd (readexactly)", ["receive_raw_data (", "readexactly (", "feed_data (",
                                                  "_wait_for_data ("]),
    ("reducer: sum parts (zeros, add_, div_)", ["accumulate_part (", "reset_accumulators (",
                                               "check_current_part_finished ("]),
    ("reducer: delta = average - part", ["<lambda> (hivemind/averaging/allreduce.py:354",
                                         "_communicate_with_peer (hivemind/averaging/allreduce.py:210"]),
    ("output: torch.cat of parts", ["iterate_output_tensors ("]),
    ("output: tensor.add_(delta) into the buffer", ["_run_allreduce_inplace_ ("]),
    ("load balancing (scipy LP)", ["load_balance_peers", "optimize_parts_lp"]),
    ("matchmaking + DHT calls", ["matchmaking.py", "hivemind/dht/", "key_manager.py", "_declare_for_download"]),
    ("asyncio / uvloop / hivemind async plumbing", ["asyncio/", "hivemind/utils/asyncio.py",
                                                    "hivemind/p2p/", "concurrent/futures", "threading.py",
                                                    "allreduce.py", "averager.py", "engine.py", "partition.py",
                                                    "uvloop"]),
]
USER_RULES: List[Tuple[str, Sequence[str]]] = [
    ("write(buffers): copy into the shared buffer", ["write (allreduce.py", "write (benchmarks/allreduce.py"]),
    ("finiteness scan before sending", ["swarm_opt/_hivemind/tensor_averager.py:BEFORE"]),
    ("finiteness scan of the result", ["swarm_opt/_hivemind/tensor_averager.py:AFTER"]),
    ("schedule / trigger / wait (StepControl, pipes)", ["averaging.py", "hivemind/"]),
]
OUTSIDE_USER = "outside all_reduce (gloo, barriers, matchmaking poll)"


def finite_lines() -> Tuple[List[int], List[int]]:
    """The lines of ``TensorAverager.all_reduce`` that scan for NaN/inf before sending and after the round."""
    lines = (REPO / "swarm_opt" / "averaging.py").read_text().splitlines()
    scans = [i + 1 for i, line in enumerate(lines) if "isfinite" in line]
    rounds = [i + 1 for i, line in enumerate(lines) if "self.schedule(get_dht_time(), round_id)" in line]
    split = rounds[0] if rounds else 10**9
    return [n for n in scans if n < split], [n for n in scans if n > split]


def classify(stack: List[str], rules: List[Tuple[str, Sequence[str]]], default: str) -> str:
    """The stage of one sample: the innermost frame that a specific rule names; the last rule (the generic one) only
    when no specific rule matches any frame (a socket write inside asyncio's StreamWriter is a socket write)."""
    for subset in (rules[:-1], rules[-1:]):
        for frame in reversed(stack):  # innermost first
            for name, needles in subset:
                if any(needle in frame for needle in needles):
                    return name
    return default


# --- /proc sampling -------------------------------------------------------------------------------------------------
def proc_stat(pid: int) -> Optional[Tuple[int, int, int]]:
    """(ppid, cpu ticks, start time in ticks) of ``pid``; None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])


def thread_ticks(pid: int) -> Dict[int, int]:
    """tid -> CPU ticks of every thread of ``pid``."""
    ticks = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return ticks
    for tid in tids:
        try:
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        ticks[int(tid)] = int(fields[11]) + int(fields[12])
    return ticks


def thread_kind(name: str) -> str:
    """hivemind's averager threads by what they do (py-spy names them; numbered pools collapse into one kind)."""
    if name.startswith("Thread-") and "_run_internal" in name:
        return "event loop thread (asyncio/uvloop, pb, sockets)"
    if name.startswith(("uvloop", "ThreadPoolExecutor")):
        return "executor threads (encode/decode, reducer maths)"
    if "mpfuture" in name:
        return "MPFuture backend thread (pipes to the user process)"
    return name


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> Dict[int, int]:
    """pid -> ppid of every live descendant of ``root``."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None:
                parents[int(entry)] = st[0]
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = ppid
                frontier.append(pid)
    return found


class Peer:
    def __init__(self, worker: int) -> None:
        self.worker, self.rank = worker, -1
        args = cmdline(worker).split()
        if "--rank" in args:
            self.rank = int(args[args.index("--rank") + 1])
        self.roles: Dict[int, str] = {worker: "user process"}


def roles_of(orchestrator: int, peers: Dict[int, Peer]) -> None:
    """Find every peer's processes: its worker (user process), DHT, p2pd and averager. The DHT and the averagers are
    forks of the worker (same command line); the DHT is the one that started p2pd."""
    tree = descendants(orchestrator)
    for pid, ppid in tree.items():
        if ppid == orchestrator and "--worker" in cmdline(pid) and pid not in peers:
            peers[pid] = Peer(pid)
    daemons = {pid: ppid for pid, ppid in tree.items() if "p2pd" in cmdline(pid)}  # p2pd -> the DHT process
    for peer in peers.values():
        worker_cmd = cmdline(peer.worker)
        for pid, ppid in tree.items():
            if ppid != peer.worker or peer.roles.get(pid) == "DHT process":
                continue
            command = cmdline(pid)  # read again each time: a helper is a fork of the worker until it execs, and a
            if pid in daemons.values():  # process that is being forked may show an empty command line
                peer.roles[pid] = "DHT process"
            elif command and command != worker_cmd:
                peer.roles[pid] = "helper processes (multiprocessing)"
            elif command and "DHT process" in peer.roles.values():  # a later fork: an averager (the DHT forks first)
                peer.roles[pid] = "averager process"
        for pid, ppid in daemons.items():
            if peer.roles.get(ppid) == "DHT process":
                peer.roles.setdefault(pid, "p2pd daemon (Go)")


def cpu_in_windows(series: List[Tuple[float, int]], windows: List[Tuple[float, float]]) -> float:
    """CPU seconds a process used inside ``windows``, interpolating its cumulative-ticks series."""
    import numpy as np

    if len(series) < 2:
        return 0.0
    ts = np.array([t for t, _ in series])
    ticks = np.array([c for _, c in series], dtype=float)
    total = 0.0
    for start, end in windows:
        total += float(np.interp(end, ts, ticks) - np.interp(start, ts, ticks)) / TICK
    return total


# --- main -----------------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--size", type=lambda s: int(float(s)), default=10_000_000)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    parser.add_argument("--no-spy", action="store_true",
                        help="CPU accounting only (py-spy's pauses slow a loaded 2-core machine down)")
    parser.add_argument("--bin-ms", type=float, default=100.0, help="time bins of the CPU timeline")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--keep", default=None, help="copy the py-spy files and CPU series to this folder")
    parser.add_argument("bench_args", nargs="*", help="extra arguments for allreduce.py (after --)")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not args.no_spy and not Path(py_spy).exists():
        raise SystemExit("py-spy not found: `pip install py-spy`, or pass --no-spy for the CPU accounting alone")
    out_name = args.out or f"profile_allreduce_w{args.peers}.json"
    before, after = finite_lines()

    with tempfile.TemporaryDirectory(prefix="swarm_profile_") as tmp_name:
        tmp = Path(tmp_name)
        bench_out = f"_profile_bench_w{args.peers}.json"
        bench = subprocess.Popen(
            [sys.executable, str(BENCH), "--sizes", str(args.size), "--peers", str(args.peers), "--reps",
             str(args.reps), "--warmup", "1", "--trace", "--no-plot", "--out", bench_out, *args.bench_args],
            cwd=str(REPO), stdout=open(tmp / "bench.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        peers: Dict[int, Peer] = {}
        series: Dict[int, List[Tuple[float, int]]] = collections.defaultdict(list)
        thread_series: Dict[Tuple[int, int], List[Tuple[float, int]]] = collections.defaultdict(list)
        spies: Dict[int, subprocess.Popen] = {}
        deadline = time.monotonic() + args.timeout
        try:
            while bench.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"benchmark did not finish in {args.timeout:.0f} s")
                roles_of(bench.pid, peers)
                now = time.time()
                for peer in peers.values():
                    for pid, role in peer.roles.items():
                        st = proc_stat(pid)
                        if st is not None:
                            series[pid].append((now, st[1]))
                        if role == "averager process":
                            for tid, ticks in thread_ticks(pid).items():
                                thread_series[(pid, tid)].append((now, ticks))
                        if (role in ("averager process", "user process") and pid not in spies and st is not None
                                and not args.no_spy):
                            spies[pid] = subprocess.Popen(
                                [py_spy, "record", "-p", str(pid), "-r", str(args.rate), "-f",
                                 "raw", "-o", str(tmp / f"spy_{pid}.txt"), "--threads",
                                 *(["--gil"] if role == "averager process" else [])],
                                stdout=subprocess.DEVNULL, stderr=open(tmp / f"spy_{pid}.log", "w"),
                                start_new_session=True)
                time.sleep(0.02)
            if bench.returncode != 0:
                raise RuntimeError(f"allreduce.py failed:\n{(tmp / 'bench.log').read_text()[-4000:]}")
        finally:
            try:
                os.killpg(bench.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for spy in spies.values():  # py-spy writes its file when the profiled process exits
                try:
                    spy.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(spy.pid, signal.SIGINT)
                    spy.wait(10)
        print((tmp / "bench.log").read_text())
        if args.keep:  # the raw material, to look at again without another run
            (tmp / "series.json").write_text(json.dumps({"series": series, "roles": {
                str(pid): role for peer in peers.values() for pid, role in peer.roles.items()}}))
            shutil.copytree(tmp, args.keep, dirs_exist_ok=True)
        bench_json = RESULTS_DIR / bench_out
        entry = json.loads(bench_json.read_text())["results"][0]
        bench_json.unlink()
        windows = [tuple(w) for w in entry["swarm_windows"]]
        wall = sum(end - start for start, end in windows)
        rounds = len(windows)

        # CPU by role, summed over peers, per round
        cpu_by_role: Dict[str, float] = collections.defaultdict(float)
        for peer in peers.values():
            for pid, role in peer.roles.items():
                cpu_by_role[role] += cpu_in_windows(series[pid], windows)
        cores = os.cpu_count() or 1

        # when in the round each kind of process is busy: cores used per time bin, averaged over the rounds
        bin_s = args.bin_ms / 1000
        timeline: Dict[str, List[float]] = {}
        n_bins = int(max(end - start for start, end in windows) / bin_s) + 1
        for role in sorted(cpu_by_role):
            used = []
            for k in range(n_bins):
                bins = [(start + k * bin_s, start + (k + 1) * bin_s) for start, end in windows
                        if start + (k + 1) * bin_s <= end]
                if not bins:
                    break
                cpu = sum(cpu_in_windows(series[pid], bins) for peer in peers.values()
                          for pid, r in peer.roles.items() if r == role)
                used.append(cpu / (len(bins) * bin_s))
            timeline[role] = used

        # py-spy samples
        samples: Dict[str, Dict[str, int]] = {"averager process": collections.Counter(),
                                              "user process": collections.Counter()}
        tid_names: Dict[int, str] = {}
        for peer in peers.values():
            for pid, role in peer.roles.items():
                path = tmp / f"spy_{pid}.txt"
                if role not in samples or not path.exists():
                    continue
                for line in path.read_text().splitlines():
                    stack_text, _, count = line.rpartition(" ")
                    stack = stack_text.split(";")
                    if role == "user process":
                        stack = [f.replace(f"averaging.py:{n})", "averaging.py:BEFORE)") if n in before else f
                                 for f in stack for n in [_line_no(f)]]
                        stack = [f.replace(f"averaging.py:{n})", "averaging.py:AFTER)") if n in after else f
                                 for f in stack for n in [_line_no(f)]]
                        inside = any("all_reduce (swarm_opt/_hivemind/tensor_averager.py" in f for f in stack)
                        category = classify(stack, USER_RULES, "other") if inside else OUTSIDE_USER
                    else:
                        category = classify(stack, AVERAGER_RULES, "other")
                        tid_text, _, thread_name = stack[0].partition(": ")
                        tid_names[int(tid_text.strip("thread ()"))] = thread_name
                    samples[role][category] += int(count)

    rows = [[role, f"{cpu / rounds:.3f}", f"{cpu / (wall * cores) * 100:.0f} %"]
            for role, cpu in sorted(cpu_by_role.items(), key=lambda kv: -kv[1])]
    total_cpu = sum(cpu_by_role.values())
    rows.append(["all processes", f"{total_cpu / rounds:.3f}", f"{total_cpu / (wall * cores) * 100:.0f} %"])
    print(f"\n{args.peers} peers, {args.size / 1e6:g}M float32, {rounds} timed rounds, mean wall "
          f"{wall / rounds:.3f} s per round (median {entry['swarm_allreduce_s']['median']:.3f} s); "
          f"{cores} cores = {cores * wall / rounds:.3f} CPU-s available per round\n")
    print(table(["process (all peers)", "CPU s per round", f"share of {cores} cores x wall"], rows))
    roles = [r for r in timeline if any(timeline[r])]
    print(f"\ncores busy (all peers), by {args.bin_ms:g} ms of the round (rounds that last that long):\n")
    print(table(["ms", *roles, "sum"], [[f"{k * args.bin_ms:.0f}", *(f"{timeline[r][k]:.2f}" for r in roles),
                                        f"{sum(timeline[r][k] for r in roles):.2f}"]
                                       for k in range(min(len(timeline[r]) for r in roles))]))
    spy_tables = {}
    for role, counter in samples.items():
        total = sum(counter.values())
        if not total:
            continue
        sample_s = 1.0 / args.rate
        spy_rows = [[name, n, f"{n * sample_s / (rounds * args.peers):.3f}", f"{n / total * 100:.1f} %"]
                    for name, n in counter.most_common()]
        spy_tables[role] = dict(counter)
        kind = "samples holding the GIL" if role == "averager process" else "samples of active threads"
        print(f"\npy-spy, {role} (all peers, {kind}, {args.rate} Hz, whole run):\n")
        print(table(["stage", "samples", "s per round per peer", "share"], spy_rows))
    cpu_by_thread: Dict[str, float] = collections.defaultdict(float)
    for (pid, tid), ticks in thread_series.items():
        if tid == pid:
            name = "main thread (joins the loop thread)"
        else:  # without py-spy the threads have no names
            name = thread_kind(tid_names.get(tid, "other threads (run with py-spy to name them)"))
        cpu_by_thread[name] += cpu_in_windows(ticks, windows)
    print("\naverager CPU by thread, inside the timed windows (all peers):\n")
    print(table(["thread", "CPU s per round", "CPU s per round per peer"],
                [[name, f"{cpu / rounds:.3f}", f"{cpu / rounds / args.peers:.3f}"]
                 for name, cpu in sorted(cpu_by_thread.items(), key=lambda kv: -kv[1])]))
    path = write_json(out_name, {"benchmark": "profile_allreduce", "peers": args.peers, "size": args.size,
                                 "rounds": rounds, "wall_per_round": wall / rounds, "cpu_per_round_by_role":
                                 {k: v / rounds for k, v in cpu_by_role.items()}, "py_spy_samples": spy_tables,
                                 "timeline_cores_by_role": timeline, "timeline_bin_ms": args.bin_ms,
                                 "averager_cpu_per_round_by_thread": {k: v / rounds for k, v in cpu_by_thread.items()},
                                 "py_spy_rate": args.rate, "allreduce_entry": entry})
    print(f"\nwrote {path}\nreproduce: {command_line()}")


def _line_no(frame: str) -> int:
    try:
        return int(frame.rsplit(":", 1)[1].rstrip(")"))
    except (IndexError, ValueError):
        return -1


if __name__ == "__main__":
    sys.exit(main())
