"""swarm_opt against NVIDIA FLARE itself, in one run: FedAvg and SCAFFOLD through Lightning, 8 clients / peers,
non-IID MNIST-5k (Dirichlet α over the labels), ``32-true`` and ``bf16-mixed``.

NVFlare 2.9.0 (``benchmarks/install_nvflare.sh``) runs as its hello-lightning example does: a job of its
``FedAvgRecipe`` or ``ScaffoldRecipe`` executed by its simulator (``SimEnv(num_clients=8, num_threads=8)``: a server
process and one process per client, on this machine), every client running ``lit_nvflare.py`` (a plain Lightning
script plus ``nvflare.client.lightning.patch(trainer)``, which applies SCAFFOLD by itself when the server sends
controls). swarm_opt runs 8 real peer processes of ``lit_swarm.py`` (the plain script plus
``SwarmCallback(strategy=LocalUpdates() or Scaffold())``, one hivemind DHT each, no server) with the start protocol of
``noniid.run_swarm``. Both run the same LightningModule code (``lit_mnist.py``; NVFlare's API needs
``pytorch_lightning``, SwarmCallback ``lightning.pytorch``), the same model and initialisation (MLP 784-64-10,
``noniid.make_model(seed)``), the same split (``noniid.dirichlet_split``), the same batch stream per client, inner
SGD lr 0.05, batch 32, ``--steps`` local steps per client per round (swarm_opt: ``TrackerConfig(shares="equal")``,
so every peer takes its equal share of each round's global batch, as NVFlare's clients take ``max_steps``), the same
``--step-sleep`` per step (a stand-in for a bigger model's compute) and ``--rounds`` rounds. The sides take turns:
for each setting, FedAvg and SCAFFOLD of one side, then of the other, the side that goes first alternating.

Reported per side, algorithm, α, precision and seed: test accuracy on the 1000 held-out digits per round (NVFlare:
the global model each client receives, and the server's last saved model; swarm_opt: the peers' model after each
round they commit), final accuracy (mean of the last ``--last`` rounds), SCAFFOLD's gain over FedAvg, seconds per
round (median interval between round boundaries from the second round on), SCAFFOLD's runtime overhead over FedAvg
(ratio of those medians, and of the whole training time), bytes per round per client (NVFlare: the tensors the
server sends a client and gets back, model and controls, without framing; swarm_opt: the tensor bytes its
all-reduces sent and received, measured), where a round's time goes (``lit_mnist.PHASES``), the load average beside
each run, and the lines each side changes in the plain Lightning script (``lit_plain.py``).

    python benchmarks/vs_nvflare.py                                  # α 0.1 and 0.01 x 32-true and bf16-mixed
    python benchmarks/vs_nvflare.py --alphas 0.1 --precisions 32-true --rounds 3 --steps 10   # a quick look
"""

from __future__ import annotations

import argparse
import ast
import difflib
import glob
import inspect
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Optional

import lit_mnist
import noniid
import torch
from _common import REPO, command_line, launch, machine, stop_workers, table, tail, write_json

BENCH = Path(__file__).resolve().parent
ALGORITHMS = {"fedavg": ("FedAvg", "LocalUpdates"), "scaffold": ("SCAFFOLD", "Scaffold")}  # label, swarm_opt's
SIDES = ("nvflare", "swarm")


def script_args(args: argparse.Namespace, tmp: Path, **extra: object) -> List[str]:
    """The options of ``lit_*.py`` (``lit_mnist.parse_args``) for this run."""
    out = ["--tmp", str(tmp), "--peers", args.peers, "--rounds", args.rounds, "--steps", args.steps,
           "--batch-size", args.batch_size, "--lr", args.lr, "--seed", args.seed, "--precision", args.precision,
           "--step-sleep", args.step_sleep, "--max-seconds", args.max_seconds]
    for key, value in extra.items():
        out += [f"--{key.replace('_', '-')}", value]
    return [str(a) for a in out]


# --- NVFlare: its recipe and simulator, in a process of their own -------------------------------------------------
def nvflare_job(args: argparse.Namespace) -> None:
    """NVFlare's job, as hello-lightning's job.py builds and runs it (runs in ``--nvflare-job`` mode)."""
    import pytorch_lightning
    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
    from nvflare.app_opt.pt.recipes.scaffold import ScaffoldRecipe
    from nvflare.recipe.sim_env import SimEnv

    tmp = Path(args.tmp)
    recipe = (FedAvgRecipe if args.algorithm == "fedavg" else ScaffoldRecipe)(
        name=f"vs_nvflare_{args.algorithm}", min_clients=args.peers, num_rounds=args.rounds,
        model=lit_mnist.classifier(pytorch_lightning)(seed=args.seed, lr=args.lr),
        train_script=str(BENCH / "lit_nvflare.py"), train_args=" ".join(script_args(args, tmp)))
    recipe.execute(env=SimEnv(num_clients=args.peers, num_threads=args.peers, workspace_root=str(tmp / "nvflare")))


def nvflare_processes(tmp: Path) -> List[int]:
    """The simulator's processes of this run (its clients run in sessions of their own, so killing the job's process
    group misses them): every process whose command line names this run's folder."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if str(tmp).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def run_nvflare(args: argparse.Namespace, tmp: Path, algorithm: str) -> dict:
    """One NVFlare run; returns the clients' records, the server's last model's accuracy and the elapsed time."""
    started = time.monotonic()
    log = tmp / f"nvflare_{algorithm}.log"
    env = {"PYTHONPATH": os.pathsep.join([str(BENCH), str(REPO)]), "MKL_NUM_THREADS": "1"}
    proc = launch([__file__, "--nvflare-job", "--algorithm", algorithm, *script_args(args, tmp)], log, env)
    try:
        proc.wait(args.max_seconds + 300)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"NVFlare's simulator did not finish in time:\n{tail(log)}") from None
    finally:
        for pid in nvflare_processes(tmp):  # nothing is left after a clean run; after a failure, its clients
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        site_logs = sorted(Path(p) for p in glob.glob(str(tmp / "nvflare" / "**" / "log.txt"), recursive=True))
        for site_log in site_logs:  # the server's and every site's own log, kept beside the simulator's output
            name = "_".join(site_log.relative_to(tmp / "nvflare").parts[1:-1])
            (tmp / f"nvflare_{algorithm}_{name}.log").write_bytes(site_log.read_bytes())
        stop_workers([proc], [log, *sorted(tmp.glob(f"nvflare_{algorithm}_*.log"))],
                     keep_logs_as=f"{Path(args.out).stem}_nvflare_{algorithm}")
    if proc.returncode != 0:
        raise RuntimeError(f"NVFlare's simulator exited with {proc.returncode}:\n{tail(log)}")
    clients = [json.loads((tmp / f"result{r}.json").read_text()) for r in range(args.peers)]
    saved = glob.glob(str(tmp / "nvflare" / "**" / "FL_global_model.pt"), recursive=True)
    if not saved:
        raise RuntimeError(f"NVFlare's server saved no model under {tmp / 'nvflare'}")
    module = noniid.make_model(args.seed)  # the LightningModule's `model`
    state = torch.load(saved[0], weights_only=False)
    module.load_state_dict({k[len("model."):]: torch.as_tensor(v) for k, v in state.get("model", state).items()})
    data = torch.load(tmp / "data.pt")
    final = float((module(data["xt"]).argmax(dim=1) == data["yt"]).float().mean())
    for r in range(args.peers):
        (tmp / f"result{r}.json").unlink()
    shutil.rmtree(tmp / "nvflare")
    return dict(clients=clients, final_model_accuracy=final, elapsed_s=time.monotonic() - started)


# --- swarm_opt: real peers -----------------------------------------------------------------------------------------
def run_swarm(args: argparse.Namespace, tmp: Path, algorithm: str) -> dict:
    started = time.monotonic()
    args.out_real = f"{Path(args.out).stem}_swarm_{algorithm}"  # names the kept logs
    strategy = ALGORITHMS[algorithm][1]
    peers = noniid.run_swarm(args, strategy, tmp, argv=lambda rank: [
        str(BENCH / "lit_swarm.py"), *script_args(args, tmp, rank=rank, strategy=strategy)])
    return dict(clients=peers, elapsed_s=time.monotonic() - started)


# --- summaries -----------------------------------------------------------------------------------------------------
def median_interval(ends: List[float]) -> Optional[float]:
    """Median time between successive round boundaries, from the second round on (the first includes start-up)."""
    gaps = [b - a for a, b in zip(ends[1:], ends[2:])]
    return statistics.median(gaps) if gaps else None


def summarize(side: str, algorithm: str, run: dict, args: argparse.Namespace, params: int) -> dict:
    """Accuracy per round, final accuracy, seconds and bytes per round, the phases of a round (mean over clients
    and rounds from the second on), for one side's run."""
    clients = run["clients"]
    if side == "nvflare":
        # record r: the global model after r rounds (received at the start of round r + 1); + the server's last
        per_round = [statistics.fmean(c["rounds"][r]["accuracy"] for c in clients) for r in range(args.rounds)]
        accuracy = per_round + [run["final_model_accuracy"]]
        boundaries = [statistics.median(c["rounds"][r]["t"] for c in clients) for r in range(args.rounds)]
        phases = [rec for c in clients for rec in c["rounds"][2:]]  # rounds 1 .. R-1 (round 0: start-up)
        factor = 2 if algorithm == "fedavg" else 4  # model down and up; SCAFFOLD: and controls down and up
        bytes_per_round = factor * 4 * params
        committed = [args.peers] * args.rounds
        spread = 0.0  # one global model
    else:
        per_round = noniid.swarm_per_round(clients, args.rounds)
        accuracy = [clients[0]["rounds"][0]["accuracy"]] + [r["accuracy_mean"] for r in per_round]
        boundaries = [0.0] + [r["t"] for r in per_round if r["t"] is not None]
        phases = [rec for c in clients for rec in c["rounds"][2:] if not rec.get("caught_up")]
        per_peer = []  # the all-reduces' tensor bytes sent and received, over the rounds the peer committed
        for c in clients:
            recs = [rec for rec in c["rounds"] if rec.get("bytes_sent") is not None]
            if recs:
                per_peer.append((recs[-1]["bytes_sent"] + recs[-1]["bytes_received"]) / len(recs))
        bytes_per_round = statistics.fmean(per_peer) if per_peer else None
        committed = [r["committed"] for r in per_round]
        spread = max(c.get("max_param_diff_vs_peer0", 0.0) for c in clients)
    known = [a for a in accuracy[1:] if a is not None]
    round_s = median_interval(boundaries)
    phase_means = {p: statistics.fmean(rec[p] for rec in phases) if phases else None for p in lit_mnist.PHASES}
    if round_s is not None and phases:
        phase_means["other"] = round_s - sum(phase_means[p] for p in lit_mnist.PHASES)
    return dict(side=side, algorithm=algorithm, accuracy=accuracy, final=statistics.fmean(known[-args.last:]),
                round_s=round_s, train_s=boundaries[-1] if boundaries else None, bytes_per_round=bytes_per_round,
                phases=phase_means, committed=committed, elapsed_s=run["elapsed_s"], load=run["load"],
                max_param_diff_between_peers=spread,
                steps=[[rec["steps"] for rec in c["rounds"][1:]] for c in clients])


def lines_changed() -> Dict[str, int]:
    """Lines added or changed, and removed, against ``lit_plain.py`` (docstrings, comments and blank lines aside);
    NVFlare's job definition (``nvflare_job``'s statements but its imports: the server side a user writes too)
    counted apart."""
    def code(path: Path) -> List[str]:
        source = path.read_text()
        tree = ast.parse(source)
        skip = set()
        doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
        if doc is not None:
            skip = set(range(doc.lineno, doc.end_lineno + 1))
        return [line for i, line in enumerate(source.splitlines(), 1)
                if i not in skip and line.strip() and not line.lstrip().startswith("#")]

    plain = code(BENCH / "lit_plain.py")
    out = {}
    for side, name in (("nvflare", "lit_nvflare.py"), ("swarm", "lit_swarm.py")):
        diff = [line for line in difflib.unified_diff(plain, code(BENCH / name), lineterm="", n=0)
                if not line.startswith(("+++", "---"))]
        out[f"{side}_added"] = sum(line.startswith("+") for line in diff)  # new or changed lines
        out[f"{side}_removed"] = sum(line.startswith("-") for line in diff)
    function = ast.parse(textwrap.dedent(inspect.getsource(nvflare_job))).body[0]
    source = textwrap.dedent(inspect.getsource(nvflare_job)).splitlines()
    statements = [st for st in function.body[1:] if not isinstance(st, (ast.Import, ast.ImportFrom))]
    out["nvflare_job"] = sum(1 for st in statements for line in source[st.lineno - 1:st.end_lineno] if line.strip())
    return out


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def report(summaries: List[dict], args: argparse.Namespace, changed: Dict[str, int]) -> List[str]:
    """Print the tables; return the goal lines."""
    rows, goals = [], []
    keys = sorted({(s["alpha"], s["precision"], s["seed"]) for s in summaries}, key=lambda k: (-k[0], k[1], k[2]))
    for key in keys:
        mine = {(s["side"], s["algorithm"]): s for s in summaries if (s["alpha"], s["precision"], s["seed"]) == key}
        for side in SIDES:
            f, s = mine.get((side, "fedavg")), mine.get((side, "scaffold"))
            if not (f and s):
                continue
            rows.append([*key, side, f"{100 * f['final']:.2f}", f"{100 * s['final']:.2f}",
                         f"{100 * (s['final'] - f['final']):+.2f}", f"{f['round_s']:.2f}", f"{s['round_s']:.2f}",
                         f"{100 * (s['round_s'] / f['round_s'] - 1):+.1f} %",
                         f"{100 * (s['train_s'] / f['train_s'] - 1):+.1f} %",
                         f"{fmt_bytes(f['bytes_per_round'])} / {fmt_bytes(s['bytes_per_round'])}",
                         f"{f['load'][0]:.1f}-{f['load'][1]:.1f} / {s['load'][0]:.1f}-{s['load'][1]:.1f}"])
    print(table(["alpha", "precision", "seed", "side", f"FedAvg acc % (last {args.last})", "SCAFFOLD acc %",
                 "gain pp", "FedAvg s/round", "SCAFFOLD s/round", "overhead (s/round)", "overhead (training time)",
                 "bytes/round/client FedAvg / SCAFFOLD", "load avg before-after FedAvg / SCAFFOLD"], rows))
    print()
    rows = []
    for s in summaries:
        rows.append([s["alpha"], s["precision"], s["seed"], s["side"], ALGORITHMS[s["algorithm"]][0],
                     f"{s['round_s']:.3f}"] + [f"{s['phases'].get(p) or 0:.3f}" for p in (*lit_mnist.PHASES, "other")])
    print("where a round goes (seconds per client, mean over clients and rounds 2..R):")
    print(table(["alpha", "precision", "seed", "side", "algorithm", "s/round", *lit_mnist.PHASES, "other"], rows))
    print()
    print(f"lines of the plain Lightning script (lit_plain.py) changed: NVFlare {changed['nvflare_added']} added or "
          f"changed, {changed['nvflare_removed']} removed (and a job definition of {changed['nvflare_job']} lines); "
          f"swarm_opt {changed['swarm_added']} added or changed, {changed['swarm_removed']} removed")
    for key in keys:
        mine = {(s["side"], s["algorithm"]): s for s in summaries if (s["alpha"], s["precision"], s["seed"]) == key}
        if len(mine) < 4:
            continue
        nf, ns, sf, ss = (mine[("nvflare", "fedavg")], mine[("nvflare", "scaffold")], mine[("swarm", "fedavg")],
                          mine[("swarm", "scaffold")])
        gain_nvflare, gain_swarm = ns["final"] - nf["final"], ss["final"] - sf["final"]
        over_nvflare, over_swarm = ns["round_s"] / nf["round_s"] - 1, ss["round_s"] / sf["round_s"] - 1
        worst_gap = max(abs(sf["final"] - nf["final"]), abs(ss["final"] - ns["final"]))
        per_round = max(abs(a - b) for x, y in ((sf, nf), (ss, ns)) for a, b in zip(x["accuracy"], y["accuracy"])
                        if a is not None and b is not None)
        faster = sf["round_s"] <= nf["round_s"] and ss["round_s"] <= ns["round_s"]
        line = (f"alpha={key[0]} {key[1]} seed {key[2]}: SCAFFOLD's gain swarm_opt {100 * gain_swarm:+.2f} pp vs "
                f"NVFlare {100 * gain_nvflare:+.2f} pp ({'met' if gain_swarm >= gain_nvflare else 'MISSED'}); "
                f"its overhead per round {100 * over_swarm:+.1f} % ({ss['round_s'] - sf['round_s']:+.3f} s) vs "
                f"{100 * over_nvflare:+.1f} % ({ns['round_s'] - nf['round_s']:+.3f} s) "
                f"({'met' if over_swarm <= over_nvflare else 'MISSED'}; NVFlare's announced +16.9 %: "
                f"{'met' if over_swarm <= 0.169 else 'MISSED'}); accuracy against NVFlare FedAvg "
                f"{100 * (sf['final'] - nf['final']):+.2f} pp, SCAFFOLD {100 * (ss['final'] - ns['final']):+.2f} pp "
                f"(within 0.5: {'met' if worst_gap <= 0.005 else 'MISSED'}; largest difference in any round "
                f"{100 * per_round:.2f} pp); s/round FedAvg {sf['round_s']:.2f} vs {nf['round_s']:.2f}, SCAFFOLD "
                f"{ss['round_s']:.2f} vs {ns['round_s']:.2f} ({'met' if faster else 'MISSED'})")
        goals.append(line)
        print(line)
    return goals


def run(args: argparse.Namespace) -> None:
    fingerprint = noniid.code_fingerprint()
    x, y, xt, yt = noniid.load_data(0)
    params = sum(p.numel() for p in noniid.make_model(0).parameters())
    changed = lines_changed()
    summaries, runs = [], []
    started = time.monotonic()
    turn = 0
    with tempfile.TemporaryDirectory(prefix="vs_nvflare_") as tmp_name:
        tmp = Path(tmp_name)
        for precision in args.precisions:
            for alpha in args.alphas:
                for seed in args.seeds:
                    shards, _ = noniid.dirichlet_split(y, args.peers, alpha, seed, args.min_samples)
                    torch.save(dict(x=x, y=y, xt=xt, yt=yt, shards=shards), tmp / "data.pt")
                    args.seed, args.precision = seed, precision
                    args.real_seed, args.real_rounds = seed, args.rounds  # noniid.run_swarm's names
                    order = SIDES if turn % 2 == 0 else SIDES[::-1]
                    turn += 1
                    for side in (s for s in order if s in args.sides):
                        for algorithm in args.algorithms:
                            load_before = os.getloadavg()[0]
                            try:
                                result = (run_nvflare if side == "nvflare" else run_swarm)(args, tmp, algorithm)
                            except RuntimeError as e:
                                print(f"alpha={alpha} seed={seed} {precision} {side} {algorithm}: FAILED: "
                                      f"{str(e)[-1500:]}", flush=True)
                                runs.append(dict(alpha=alpha, seed=seed, precision=precision, side=side,
                                                 algorithm=algorithm, failed=str(e)[-3000:]))
                                continue
                            result["load"] = (load_before, os.getloadavg()[0])
                            summary = dict(summarize(side, algorithm, result, args, params), alpha=alpha, seed=seed,
                                           precision=precision)
                            summaries.append(summary)
                            runs.append(dict(summary, clients=result["clients"]))
                            write_json(args.out, dict(benchmark="vs_nvflare", command=command_line(), partial=True,
                                                      args=vars(args), summaries=summaries, runs=runs))
                            print(f"alpha={alpha} seed={seed} {precision} {side:>7} {algorithm:>8}: final "
                                  f"{100 * summary['final']:.2f} %, {summary['round_s']:.2f} s/round, "
                                  f"{result['elapsed_s']:.0f} s in all, load {load_before:.1f} -> "
                                  f"{result['load'][1]:.1f}  [{time.monotonic() - started:.0f} s]", flush=True)
    print()
    goals = report(summaries, args, changed)
    from importlib.metadata import version

    versions = {p: version(p) for p in ("nvflare", "pytorch-lightning", "lightning", "torch", "hivemind")}
    end = noniid.code_fingerprint()
    path = write_json(args.out, dict(benchmark="vs_nvflare", command=command_line(), args=vars(args),
                                     machine=machine(), versions=versions, lines_changed=changed,
                                     swarm_opt_source=fingerprint if end == fingerprint else f"{fingerprint}->{end}",
                                     elapsed_s=time.monotonic() - started, summaries=summaries, goals=goals,
                                     runs=runs))
    print(f"wrote {path}\nreproduce: {command_line()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.01])
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"],
                        choices=["32-true", "bf16-mixed"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="model init, split and batch order")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50, help="local steps per client / peer per round")
    parser.add_argument("--last", type=int, default=3, help="final accuracy = mean of the last LAST rounds")
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--min-samples", type=int, default=10)
    parser.add_argument("--step-sleep", type=float, default=0.02, help="seconds of sleep per local step, both sides")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="a side stops training after this long")
    parser.add_argument("--out", default="vs_nvflare.json")
    parser.add_argument("--nvflare-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--algorithm", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="32-true", help=argparse.SUPPRESS)
    parser.add_argument("--summarize", metavar="JSON", help="print the tables of a saved run (a partial one too)")
    args = parser.parse_args()
    if args.nvflare_job:
        return nvflare_job(args)
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
        args.last = saved["args"]["last"]
        report(saved["summaries"], args, lines_changed())  # of the scripts as they are now
        return None
    torch.set_num_threads(1)
    print(f"command: {command_line()}", flush=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
