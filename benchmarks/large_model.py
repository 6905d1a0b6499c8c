"""A ~100M-parameter language model on this machine: what a newcomer waits, what a peer holds, what a checkpoint
costs, at a size no test runs.

One CLI swarm on loopback: a ``swarm-opt dht`` bootstrap node and peers ``swarm-opt train --task lm-large`` (the
built-in 100M-parameter byte-level GPT, AdamW, bf16 autocast, clipping; ``--batch-size``/``--target-batch-size``
small, so that an epoch takes seconds to minutes on 2 cores). In order:

1. peer A trains alone, checkpointing, until it reaches ``--warm-epochs``;
2. newcomer B starts: seconds from its start to the swarm's state loaded (its log's download lines say how long the
   download itself took) and to its first epoch averaged with A;
3. while both train, each peer's processes are read ``--samples`` times (``swarm_opt.testing.process_sample``:
   PSS, and the anonymous + shared-memory part, by role: trainer, DHT, p2pd, averager), against the model and
   optimizer bytes (parameters + AdamW's two moments) and the issue's bound for gradient averaging: model +
   optimizer + 2x parameters + 300 MB;
4. A's newest checkpoint read back from disk (``load_checkpoint``: the same bytes the newcomer downloaded, read
   from a file the page cache likely holds) and written again the way ``Checkpointer`` writes (a temporary file,
   fsync, rename);
5. A is stopped with Ctrl-C (it saves a checkpoint at exit) and started again from its checkpoint directory:
   seconds to its resume line and to its first epoch averaged with B.

Round time against gloo at this size is ``benchmarks/allreduce.py --sizes 1e8 --peers 2 --lane`` (hivemind's path,
the lane, gloo).

    python benchmarks/large_model.py
    python benchmarks/large_model.py --warm-epochs 2 --target-batch-size 8 --batch-size 2
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Pattern

from _common import table, write_json

from swarm_opt import testing
from swarm_opt.testing import name_roles, process_sample, session_members

MB = 1e6
ADDRESS = re.compile(r"^(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)$", re.M)
EPOCH = re.compile(r"^epoch (\d+): ", re.M)
TOGETHER = re.compile(r"^epoch (\d+): .*averaged with 2 of 2 peer", re.M)
DOWNLOAD = re.compile(r"^(\d\d:\d\d:\d\d) INFO .*downloading its state", re.M)
LOADED = re.compile(r"^(\d\d:\d\d:\d\d) INFO .*Loaded the swarm's state", re.M)
RESUMED = re.compile(r"resumed from \S+ \(epoch (\d+)\)", re.M)


class Peer:
    """A ``swarm-opt`` process whose log is watched: ``seen[name]`` is when ``patterns[name]`` first matched, in
    seconds after the start."""

    def __init__(self, name: str, argv: List[str], workdir: Path, patterns: Dict[str, Pattern]) -> None:
        self.name, self.log, self.patterns = name, workdir / f"{name}.out", patterns
        self.started = time.monotonic()
        self.proc = testing.start(["-m", "swarm_opt", *argv], log=self.log, cwd=workdir)
        self.seen: Dict[str, float] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            text = self.text()
            for name, pattern in self.patterns.items():
                if name not in self.seen and pattern.search(text):
                    self.seen[name] = time.monotonic() - self.started

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, name: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while name not in self.seen:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before {name!r}:\n"
                                   f"{testing.tail(self.log, 30)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no {name!r} within {timeout:.0f} s:\n{testing.tail(self.log, 30)}")
            time.sleep(0.2)
        return self.seen[name]

    def epochs(self) -> int:
        found = EPOCH.findall(self.text())
        return int(found[-1]) if found else 0

    def stop(self, timeout: float = 180.0) -> Optional[int]:
        testing.signal_group(self.proc, signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            testing.kill([self.proc])
            return None
        finally:
            self._stop.set()


def seconds_between(text: str, first: Pattern, second: Pattern) -> Optional[float]:
    """Seconds between the log's first lines matching ``first`` and ``second`` (their HH:MM:SS stamps)."""
    a, b = first.search(text), second.search(text)
    if not (a and b):
        return None
    stamp = [sum(int(x) * m for x, m in zip(found.group(1).split(":"), (3600, 60, 1))) for found in (a, b)]
    return float((stamp[1] - stamp[0]) % 86400)


def memory(peer: Peer) -> Dict[str, Dict[str, float]]:
    procs = [p for p in map(process_sample, session_members(peer.proc.pid)) if p]
    name_roles(peer.proc.pid, procs)
    return {p["role"]: {"pss": p["pss"] / MB, "anon": p["anon"] / MB, "rss": p["rss"] / MB} for p in procs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="lm-large")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--target-batch-size", type=int, default=8)
    parser.add_argument("--warm-epochs", type=int, default=2, help="epochs peer A trains alone before B starts")
    parser.add_argument("--samples", type=int, default=5, help="memory samples while both train, 3 s apart")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed for each phase")
    parser.add_argument("--workdir", help="keep the logs and checkpoints here (default: a temporary directory)")
    args = parser.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="large_model_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"logs and checkpoints in {workdir}", flush=True)
    peers: List[Peer] = []
    try:
        node = Peer("dht", ["dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], workdir, {"address": ADDRESS})
        peers.append(node)
        node.wait("address", 90)
        bootstrap = ADDRESS.search(node.text()).group(1)

        def train(name: str, seed: int, checkpoints: str) -> Peer:
            argv = ["train", "--run-id", "large", "--initial-peers", bootstrap, "--host-maddrs",
                    "/ip4/127.0.0.1/tcp/0", "--task", args.task, "--batch-size", str(args.batch_size),
                    "--target-batch-size", str(args.target_batch_size), "--data-seed", str(seed),
                    "--checkpoint-dir", checkpoints, "--checkpoint-every", "1", "--eval-every", "1000", "-v"]
            peer = Peer(name, argv, workdir, {"epoch 1": re.compile(r"^epoch 1: ", re.M), "together": TOGETHER,
                                              "loaded": LOADED, "resumed": RESUMED})
            peers.append(peer)
            return peer

        first = train("A", 1, "ckpt-A")
        first.wait("epoch 1", args.timeout)
        alone_started = time.monotonic()
        while first.epochs() < args.warm_epochs:
            if time.monotonic() - alone_started > args.timeout or first.proc.poll() is not None:
                raise RuntimeError(f"A did not reach epoch {args.warm_epochs}:\n{testing.tail(first.log, 30)}")
            time.sleep(0.5)
        epoch_alone = (time.monotonic() - alone_started) / max(1, args.warm_epochs - 1)

        newcomer = train("B", 2, "ckpt-B")
        loaded = newcomer.wait("loaded", args.timeout)
        together = newcomer.wait("together", args.timeout)
        download = seconds_between(newcomer.text(), DOWNLOAD, LOADED)

        samples: List[Dict[str, Dict[str, Dict[str, float]]]] = []
        for _ in range(args.samples):
            samples.append({p.name: memory(p) for p in (first, newcomer)})
            time.sleep(3)

        from swarm_opt.checkpoint import _atomic_save, load_checkpoint

        newest = sorted((workdir / "ckpt-A").glob("epoch-*.pt"))[-1]
        began = time.perf_counter()
        state = load_checkpoint(newest)
        read_s = time.perf_counter() - began
        began = time.perf_counter()
        _atomic_save(state, workdir / "rewritten.pt")
        write_s = time.perf_counter() - began
        size = newest.stat().st_size
        (workdir / "rewritten.pt").unlink()
        params = sum(t.numel() for t in state["model"].values() if hasattr(t, "numel"))
        del state

        stopped = time.monotonic()
        exit_code = first.stop()
        stop_s = time.monotonic() - stopped
        peers.remove(first)
        again = train("A-again", 1, "ckpt-A")
        resumed = again.wait("resumed", args.timeout)
        rejoined = again.wait("together", args.timeout)
    finally:
        for peer in reversed(peers):
            peer.stop(60)

    param_mb, optimizer_mb = params * 4 / MB, params * 8 / MB
    bound = param_mb + optimizer_mb + 2 * param_mb + 300
    roles = sorted({role for s in samples for peer in s.values() for role in peer})
    rows, memory_result = [], {}
    for name in ("A", "B"):
        per_role = {role: statistics.median(s[name].get(role, {}).get("pss", 0.0) for s in samples) for role in roles}
        anon = {role: statistics.median(s[name].get(role, {}).get("anon", 0.0) for s in samples) for role in roles}
        total, total_anon = sum(per_role.values()), sum(anon.values())
        memory_result[name] = {"pss_mb": per_role, "anon_mb": anon, "total_pss_mb": total,
                               "total_anon_mb": total_anon}
        rows.append([name, *(f"{per_role[r]:.0f}" for r in roles), f"{total:.0f}", f"{total_anon:.0f}",
                     f"{bound:.0f}", f"{total_anon / bound:.2f}"])
    print(f"\n{args.task}: {params / 1e6:.1f}M parameters ({param_mb:.0f} MB), AdamW state {optimizer_mb:.0f} MB; "
          f"batch {args.batch_size}, global batch {args.target_batch_size}; one epoch of A alone {epoch_alone:.0f} s")
    print("\nMemory per peer, median PSS in MB by process (total anon+shm: what the peer adds beyond shared "
          "library files)")
    print(table(["peer", *roles, "total PSS", "total anon+shm", "bound", "anon+shm / bound"], rows))
    timing = {"newcomer: start -> state loaded": loaded, "newcomer: the download itself (log stamps, 1 s)": download,
              "newcomer: start -> first epoch averaged with A": together,
              f"checkpoint read from disk ({size / MB:.0f} MB, load_checkpoint)": read_s,
              "checkpoint written (temporary file, fsync, rename)": write_s,
              "Ctrl-C -> A exited (its checkpoint saved)": stop_s,
              "A restarted: start -> resumed from its checkpoint": resumed,
              "A restarted: start -> first epoch averaged with B": rejoined}
    print("\n" + table(["what", "seconds"], [[k, "-" if v is None else f"{v:.1f}"] for k, v in timing.items()]))
    path = write_json("large_model.json", {
        "task": args.task, "parameters": params, "parameter_mb": param_mb, "optimizer_mb": optimizer_mb,
        "batch_size": args.batch_size, "target_batch_size": args.target_batch_size, "epoch_alone_s": epoch_alone,
        "checkpoint_mb": size / MB, "memory": memory_result, "memory_bound_mb": bound, "seconds": timing,
        "a_exit_code": exit_code, "memory_samples": samples})
    print(f"\nwrote {path}")
    sys.exit(0 if exit_code == 0 else 1)


if __name__ == "__main__":
    main()
