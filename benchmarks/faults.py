"""What a peer that goes costs the others: swarm_opt vs hivemind.Optimizer on the same workload (4 peers).

A swarm of 4 peers (separate processes on loopback, each in its own session) trains an MLP on synthetic data with
batch 16 per step, a short sleep per step as simulated compute, ``target_batch_size=256``, ``matchmaking_time=1.0``,
``averaging_timeout=15``. Every peer appends ``<unix time> <epoch>`` to a file whenever its epoch changes. Peers start
training together (a barrier, then each waits to see all 4). Once every peer has reached epoch N-1, the victim is
killed right after it writes its next epoch: its whole process group (python, DHT, averager, p2pd) is SIGKILLed.
Victims: a non-bootstrap peer (the last rank) and the bootstrap peer (rank 0, whose multiaddrs the others used as
``initial_peers``). ``--how``: ``kill`` (SIGKILL, as above), ``shutdown`` (the victim calls ``opt.shutdown()`` and
``dht.shutdown()`` after that round, a clean leave) or ``exit`` (the victim's script ends there without calling
``shutdown()``, as a user's script that forgot ``with opt:``). ``--peers 2`` shows the worst case: the one survivor.

Measured from the epoch files, on the *swarm timeline* (for each epoch, the first time any peer of the set reached it):
- mean round s before: mean seconds per epoch from epoch 2 to the kill (all 4 peers);
- kill -> next round: from the kill to the first survivor reaching an epoch above the highest epoch any peer held at
  the kill (and, in the JSON, to *every* survivor being past it);
- mean round s after: mean seconds per epoch after that first post-kill round (survivors only), over up to
  ``--post-rounds`` epochs or ``--post-seconds``, whichever comes first.

    python benchmarks/faults.py                       # both systems, both victims, 2 repetitions
    python benchmarks/faults.py --reps 1 --systems swarm_opt --victims 3
    python benchmarks/faults.py --peers 2 --victims 1 --how shutdown exit kill --leave-after 0.4   # a partner leaves
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from _common import RESULTS_DIR, kill_all, launch, leftovers, machine, table, tail, write_json

BOOTSTRAP = 0


# --- worker ---------------------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import logging

    import hivemind
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    for attempt in range(3):  # on a loaded machine p2pd sometimes fails to reach the bootstrap peer in time
        try:
            dht = hivemind.DHT(initial_peers=json.loads(args.initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                               start=True)
            break
        except Exception as e:  # hivemind raises P2PDaemonError
            if attempt == 2:
                raise
            logging.warning(f"DHT start failed ({e}); retrying")
    if args.maddrs_file:
        tmp = args.maddrs_file + ".tmp"
        Path(tmp).write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
        os.replace(tmp, args.maddrs_file)

    g = torch.Generator().manual_seed(1234)
    dim, classes = 32, 10
    x = torch.randn(8192, dim, generator=g)
    y = (x @ torch.randn(dim, classes, generator=g)).argmax(dim=1)
    torch.manual_seed(0)  # identical initial weights on every peer
    model = torch.nn.Sequential(torch.nn.Linear(dim, 128), torch.nn.ReLU(), torch.nn.Linear(128, classes))
    factory = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    common = dict(dht=dht, run_id=args.run_id, target_batch_size=args.target_batch_size,
                  batch_size_per_step=args.batch_size, optimizer=factory, params=model.parameters(),
                  matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout)
    if args.system == "swarm_opt":
        import swarm_opt

        opt = swarm_opt.Optimizer(strategy=swarm_opt.GradientAveraging(), **common)
        num_peers = lambda: opt.progress.num_peers  # noqa: E731
    else:
        opt = hivemind.Optimizer(verbose=False, **common)
        num_peers = lambda: opt.tracker.global_progress.num_peers  # noqa: E731

    # start training together, as a swarm that already exists would be: the controller says go once every peer
    # has built its optimizer, then each waits until its tracker sees all of them
    Path(args.epochs_file + ".ready").touch()
    go = Path(args.epochs_file).with_name("go")
    while not go.exists():
        time.sleep(0.05)
    deadline = time.monotonic() + 60
    while num_peers() < args.peers and time.monotonic() < deadline:
        time.sleep(0.05)
    epochs = open(args.epochs_file, "a", buffering=1)
    epochs.write(f"{time.time():.4f} {opt.local_epoch}\n")
    last = opt.local_epoch
    rank_gen = torch.Generator().manual_seed(100 + args.rank)
    stop, leave = Path(args.epochs_file + ".stop"), Path(args.epochs_file + ".leave")
    while not stop.exists():
        if leave.exists():  # the controller's word to go (--how shutdown / exit)
            epochs.close()
            if args.how == "shutdown":
                opt.shutdown()
                dht.shutdown()
            sys.exit(0)  # "exit": the script ends here, its optimizer never shut down
        idx = torch.randint(0, len(x), (args.batch_size,), generator=rank_gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        if opt.local_epoch != last:
            last = opt.local_epoch
            epochs.write(f"{time.time():.4f} {last}\n")
        time.sleep(args.step_sleep)
    epochs.close()
    os._exit(0)  # the controller kills our process group; no slow shutdown needed


# --- controller -----------------------------------------------------------------------------------------------------
def read_epochs(path: Path) -> List[Tuple[float, int]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) == 2:
            out.append((float(parts[0]), int(parts[1])))
    return out


def swarm_timeline(records: Dict[int, List[Tuple[float, int]]], ranks, t_min=-1e18, t_max=1e18) -> Dict[int, float]:
    """For each epoch, the first time any of ``ranks`` reached it (within [t_min, t_max])."""
    first: Dict[int, float] = {}
    for r in ranks:
        for t, e in records.get(r, []):
            if t_min <= t <= t_max and (e not in first or t < first[e]):
                first[e] = t
    return first


def seconds_per_epoch(first: Dict[int, float], lo: int, hi: int) -> Optional[float]:
    """Mean seconds per epoch between epochs lo and hi of a timeline (skipped epochs are spread evenly)."""
    epochs = sorted(e for e in first if lo <= e <= hi)
    if len(epochs) < 2:
        return None
    return (first[epochs[-1]] - first[epochs[0]]) / (epochs[-1] - epochs[0])


def run_case(args, system: str, victim: int, rep: int, workdir: Path, how: str) -> dict:
    run_id = f"faults_{system}_{victim}_{rep}_{uuid.uuid4().hex[:6]}"
    case_dir = workdir / f"{system}_{how}_victim{victim}_rep{rep}"
    shutil.rmtree(case_dir, ignore_errors=True)  # a previous run's stop and ready files would end this one at once
    case_dir.mkdir(parents=True)
    procs: List[subprocess.Popen] = []
    peers = args.peers
    logs = [case_dir / f"peer{r}.log" for r in range(peers)]
    efiles = [case_dir / f"peer{r}.epochs" for r in range(peers)]
    load_start = os.getloadavg()
    t_kill = None
    try:
        initial = "[]"
        for r in range(peers):
            argv = [__file__, "--worker", "--system", system, "--rank", str(r), "--run-id", run_id,
                    "--peers", str(peers), "--how", how,
                    "--epochs-file", str(efiles[r]), "--initial-peers", initial,
                    "--batch-size", str(args.batch_size), "--target-batch-size", str(args.target_batch_size),
                    "--matchmaking-time", str(args.matchmaking_time),
                    "--averaging-timeout", str(args.averaging_timeout), "--step-sleep", str(args.step_sleep)]
            if r == BOOTSTRAP:
                argv += ["--maddrs-file", str(case_dir / "bootstrap.maddrs")]
            procs.append(launch(argv, logs[r], env_extra={"OMP_NUM_THREADS": "1"}))
            if r == BOOTSTRAP:
                maddrs = case_dir / "bootstrap.maddrs"
                deadline = time.monotonic() + 60
                while not maddrs.exists():
                    if procs[0].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"bootstrap peer did not start:\n{tail(logs[0])}")
                    time.sleep(0.05)
                initial = maddrs.read_text()

        deadline = time.monotonic() + args.warmup_timeout
        while not all(Path(str(f) + ".ready").exists() for f in efiles):
            for r, p in enumerate(procs):
                if p.poll() is not None:
                    raise RuntimeError(f"peer {r} exited early ({p.returncode}):\n{tail(logs[r])}")
            if time.monotonic() > deadline:
                raise RuntimeError("peers did not build their optimizers in time")
            time.sleep(0.05)
        (case_dir / "go").touch()

        # a healthy swarm: every peer has reached epoch N-1; then kill the victim right after its next round
        victim_epoch = None
        while True:
            recs = [read_epochs(f) for f in efiles]
            if victim_epoch is None and all(rec and rec[-1][1] >= args.kill_epoch - 1 for rec in recs):
                victim_epoch = recs[victim][-1][1]
            if victim_epoch is not None and recs[victim][-1][1] > victim_epoch:
                break
            for r, p in enumerate(procs):
                if p.poll() is not None:
                    raise RuntimeError(f"peer {r} exited early ({p.returncode}):\n{tail(logs[r])}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"victim did not reach epoch {args.kill_epoch} in {args.warmup_timeout} s:\n"
                                   f"{tail(logs[victim])}")
            time.sleep(0.005)
        time.sleep(args.leave_after)  # (default 0: right after its round; mid-epoch, the others may be matchmaking)
        t_kill = time.time()
        if how == "kill":
            os.killpg(procs[victim].pid, signal.SIGKILL)
        else:
            Path(str(efiles[victim]) + ".leave").touch()
        survivors = [r for r in range(peers) if r != victim]
        at_kill = {r: read_epochs(efiles[r]) for r in survivors}
        victim_at_kill = recs[victim][-1][1]
        e_kill = max([rec[-1][1] for rec in at_kill.values() if rec] + [victim_at_kill])
        epochs_at_kill = {r: rec[-1][1] for r, rec in at_kill.items()}
        epochs_at_kill[victim] = victim_at_kill

        # watch the survivors
        deadline = t_kill + args.post_seconds
        while time.time() < deadline:
            first = swarm_timeline({r: read_epochs(efiles[r]) for r in survivors}, survivors, t_min=t_kill)
            if first and max(first) >= e_kill + 1 + args.post_rounds:
                break
            time.sleep(0.1)
        t_end = time.time()
        for f in efiles:
            Path(str(f) + ".stop").touch()
        time.sleep(0.5)
    finally:
        kill_all(procs)
        left = leftovers(procs)
        for _ in range(50):  # SIGKILLed members of a group can take a moment to exit on a loaded machine
            if not left:
                break
            time.sleep(0.1)
            kill_all(procs)
            left = leftovers(procs)
        if left:
            print(f"WARNING: processes left behind: {left}", file=sys.stderr)

    records = {r: read_epochs(efiles[r]) for r in range(peers)}
    before_tl = swarm_timeline(records, range(peers), t_max=t_kill)
    before = seconds_per_epoch(before_tl, 2, e_kill)
    after_tl = swarm_timeline(records, survivors, t_min=t_kill, t_max=t_end)
    next_epochs = sorted(e for e in after_tl if e > e_kill)
    kill_to_next = after_tl[next_epochs[0]] - t_kill if next_epochs else None
    per_survivor = {}
    for r in survivors:
        ts = [t for t, e in records[r] if t > t_kill and e > e_kill]
        per_survivor[r] = ts[0] - t_kill if ts else None
    all_next = None if any(v is None for v in per_survivor.values()) else max(per_survivor.values())
    after = seconds_per_epoch(after_tl, next_epochs[0], 10**9) if next_epochs else None
    log_errors = {r: sum(1 for line in logs[r].read_text(errors="replace").splitlines()
                         if "ERROR" in line or "Traceback" in line) for r in survivors}
    return {"system": system, "how": how, "peers": peers, "victim": victim,
            "victim_kind": "bootstrap" if victim == BOOTSTRAP else "non-bootstrap",
            "rep": rep, "run_id": run_id, "t_kill": t_kill, "t_end": t_end, "epoch_at_kill": e_kill,
            "epochs_per_peer_at_kill": epochs_at_kill,
            "before_s_per_epoch": before, "kill_to_next_round_s": kill_to_next,
            "kill_to_all_survivors_next_s": all_next, "kill_to_next_per_survivor_s": per_survivor,
            "after_s_per_epoch": after, "epochs_after_kill": (max(next_epochs) - e_kill) if next_epochs else 0,
            "ratio_after_before": (after / before) if (after and before) else None,
            "survivor_log_error_lines": log_errors, "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg(),
            "records": {str(r): v for r, v in records.items()}, "logs": str(case_dir)}


def fmt(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def median_or_none(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def plot(cases: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c["how"], c["victim"]) for c in cases})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), sharey=True, squeeze=False)
    colors = {"swarm_opt": "tab:blue", "hivemind": "tab:red"}
    styles = ["-", "--", ":", "-."]
    for ax, (how, victim) in zip(axes[0], panels):
        for c in (c for c in cases if (c["how"], c["victim"]) == (how, victim)):
            survivors = [r for r in range(c["peers"]) if r != victim]
            recs = {int(r): v for r, v in c["records"].items()}
            tl = swarm_timeline(recs, range(c["peers"]), t_max=c["t_kill"])
            tl_after = swarm_timeline(recs, survivors, t_min=c["t_kill"], t_max=c["t_end"])
            pts = sorted([(t, e) for e, t in tl.items()] + [(t, e) for e, t in tl_after.items()])
            ax.step([t - c["t_kill"] for t, _ in pts], [e - c["epoch_at_kill"] for _, e in pts], where="post",
                    color=colors[c["system"]], linestyle=styles[c["rep"] % len(styles)],
                    label=f"{c['system']} rep {c['rep']}")
        ax.axvline(0, color="k", linewidth=1)
        ax.text(0.3, ax.get_ylim()[0] + 0.5, how, fontsize=8)
        ax.set_title(f"{how}: {'the bootstrap peer (rank 0)' if victim == BOOTSTRAP else f'rank {victim}'}")
        ax.set_xlabel("seconds since the victim went")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("swarm epoch − epoch when it went")
    peers = cases[0]["peers"]
    fig.suptitle(f"{peers} peers, GradientAveraging vs hivemind.Optimizer, target 256, matchmaking 1 s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", default="swarm_opt")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--run-id", default="faults")
    p.add_argument("--epochs-file", default="")
    p.add_argument("--maddrs-file", default="")
    p.add_argument("--initial-peers", default="[]")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--target-batch-size", type=int, default=256)
    p.add_argument("--matchmaking-time", type=float, default=1.0)
    p.add_argument("--averaging-timeout", type=float, default=15.0)
    p.add_argument("--step-sleep", type=float, default=0.05, help="simulated compute per step, seconds")
    p.add_argument("--systems", nargs="+", default=["swarm_opt", "hivemind"])
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--victims", nargs="+", type=int, help="ranks (default: the last one and the bootstrap peer)")
    p.add_argument("--how", nargs="+", default=["kill"], choices=["kill", "shutdown", "exit"],
                   help="how the victim goes (a worker takes one)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--leave-after", type=float, default=0.0, help="seconds after the victim's round that it goes")
    p.add_argument("--kill-epoch", type=int, default=7,
                   help="once every peer reached N-1, kill the victim right after its next round")
    p.add_argument("--post-rounds", type=int, default=5, help="rounds to watch after the first post-kill round")
    p.add_argument("--post-seconds", type=float, default=100.0, help="longest time to watch after the kill")
    p.add_argument("--warmup-timeout", type=float, default=150.0)
    args = p.parse_args()
    if args.worker:
        args.how = args.how[0]
        worker(args)
        return
    args.victims = args.victims or [args.peers - 1, BOOTSTRAP]
    if args.peers < 2 or not all(0 <= v < args.peers for v in args.victims):
        p.error(f"--victims must be ranks below --peers {args.peers}")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` kills the workers' groups
    workdir = RESULTS_DIR / "faults_logs"
    cases = []
    started = time.time()
    for rep in range(args.reps):
        for how, victim, system in ((h, v, s) for h in args.how for v in args.victims for s in args.systems):
            print(f"[{time.time() - started:6.0f} s] {system}, {how} victim {victim}, rep {rep} "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
            c = None
            for attempt in range(2):  # a start-up failure (before the kill) is retried once
                try:
                    c = run_case(args, system, victim, rep, workdir, how)
                    break
                except RuntimeError as e:
                    print(f"  attempt {attempt} failed: {str(e)[-1500:]}", flush=True)
                    cases.append({"system": system, "how": how, "victim": victim, "rep": rep,
                                  "error": str(e)[-3000:]})
            if c is None:
                continue
            print(f"  went->next {fmt(c['kill_to_next_round_s'])} s (all survivors "
                  f"{fmt(c['kill_to_all_survivors_next_s'])} s), before {fmt(c['before_s_per_epoch'])} s/epoch, "
                  f"after {fmt(c['after_s_per_epoch'])} s/epoch over {c['epochs_after_kill']} epochs, "
                  f"log errors {c['survivor_log_error_lines']}", flush=True)
            cases.append(c)

    ok = [c for c in cases if "error" not in c]
    rows, summary = [], []
    for how, system, victim in ((h, s, v) for h in args.how for s in args.systems for v in args.victims):
        cs = [c for c in ok if (c["system"], c["victim"], c["how"]) == (system, victim, how)]
        if not cs:
            continue
        s = {"system": system, "how": how,
             "victim": "bootstrap (rank 0)" if victim == BOOTSTRAP else f"rank {victim}",
             "n": len(cs),
             "kill_to_next_round_s": median_or_none(c["kill_to_next_round_s"] for c in cs),
             "kill_to_all_survivors_next_s": median_or_none(c["kill_to_all_survivors_next_s"] for c in cs),
             "before_s_per_epoch": median_or_none(c["before_s_per_epoch"] for c in cs),
             "after_s_per_epoch": median_or_none(c["after_s_per_epoch"] for c in cs),
             "ratio_after_before": median_or_none(c["ratio_after_before"] for c in cs),
             "per_rep_kill_to_next_s": [c["kill_to_next_round_s"] for c in cs],
             "per_rep_after_s_per_epoch": [c["after_s_per_epoch"] for c in cs]}
        summary.append(s)
        rows.append([system, how, s["victim"], s["n"], fmt(s["kill_to_next_round_s"]),
                     fmt(s["kill_to_all_survivors_next_s"]), fmt(s["before_s_per_epoch"]),
                     fmt(s["after_s_per_epoch"]), fmt(s["ratio_after_before"]) + "x",
                     " / ".join(fmt(v) for v in s["per_rep_kill_to_next_s"]),
                     " / ".join(fmt(v) for v in s["per_rep_after_s_per_epoch"])])
    headers = ["system", "how", "victim", "reps", "went->next round s", "went->all survivors s", "mean round s before",
               "mean round s after", "ratio after/before", "went->next per rep", "after per rep"]
    print(table(headers, rows))
    name = "faults" if (args.peers, args.how) == (4, ["kill"]) else f"faults_{args.peers}peers_{'_'.join(args.how)}"
    path = write_json(f"{name}.json", {"args": {k: v for k, v in vars(args).items() if k != "worker"},
                                       "summary": summary, "cases": cases, "wall_s": time.time() - started})
    if ok:
        plot(ok, RESULTS_DIR / f"{name}.png")
    print(f"wrote {path} and {RESULTS_DIR / f'{name}.png'}; load now {machine()['loadavg_at_end']}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
