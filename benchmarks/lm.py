"""The language-model benchmark: swarm_opt beside DDP, hivemind.Optimizer and the DiLoCo family on the same tokens.

Four peers, each on its own test host (a network namespace of this machine, ``tests/hosts.py``), every host's
outgoing link limited by ``tc tbf`` to ``--rates`` (default 1 Gbit/s and 100 Mbit/s). Every system trains the
built-in ``lm-SIZE`` task (default ``lm-tiny``: a 0.83M-parameter byte-level GPT on the standard library's sources,
``swarm_opt/cli/language_model.py``) with its recipe: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), bf16
autocast, gradient clipping at 1.0, linear warmup then cosine decay to 0.1x, here over the run's local steps (a
peer's local step ``k`` is the same tokens in every system: 4 peers x ``--batch`` sequences). Each peer reads its own
shard of the corpus (``--shard rank/4``); every system gets **the same token budget**, ``--steps`` local steps of each
peer: DDP makes exactly those, a swarm's peers step until the swarm has made as many global steps or rounds (a round
starts when the swarm's samples reach its target, so peers of different speeds make different numbers of steps),
and the tokens that took are counted and reported against the budget. Systems (``--systems``, taking turns in one
run, so that each sees the same load):

* ``ddp``: torch.distributed DDP over gloo, one clipped AdamW step per global batch (``--global-batch`` sequences:
  ``--global-batch / (4 x --batch)`` micro-steps with ``no_sync``); ``ddp@64``: a step per 64 sequences (one local
  batch of each peer), the baseline of the local-update strategies (a system's ``@B`` sets its global batch);
* ``hivemind/grad``: ``hivemind.Optimizer`` averaging gradients over the same global batch, as its quickstart
  configures it (``matchmaking_time=3``), clipping inside the optimizer's step as hivemind's ALBERT example does;
  ``hivemind/local``: ``use_local_updates=True`` (local AdamW steps, parameters averaged every ``--local-h`` local
  steps: what OpenDiLoCo built on);
* ``swarm_opt/grad``, ``swarm_opt/grad+overlap`` (``Overlap()``), ``swarm_opt/grad/powersgd4``: gradient averaging on
  hivemind's path; ``lane/grad``, ``lane/grad+overlap``: the same over the gloo lane (``transport=Gloo(host=...)``);
* ``swarm_opt/dilocoH/CODEC``: DiLoCo with ``H`` inner steps, outer Nesterov SGD (lr ``--outer-lr``, 0.7; momentum
  0.9; the local-update systems' inner lr is ``--inner-lr-scale`` x the recipe's), the
  pseudo-gradients sent in fp32, fp16 (``Float16``), 8 bits (``Int8Blockwise``) or ``TopK(0.01)``;
  ``swarm_opt/dilocoH+overlap/CODEC``: the same with ``Overlap()`` (the inner steps go on while a round averages).

Per system: validation loss and perplexity at equal tokens (rank 0's model, all 512 held-out windows), tokens/s (wall
time with evaluations taken out), compute utilization (seconds in forward+backward / wall seconds; DDP's all-reduce
runs inside the synchronising micro-step's backward, so that step counts as a ``no_sync`` step's compute; in
brackets, with the inner optimizer's own steps counted as compute too: what is left is communication and
coordination, and each peer lists its ``step()`` calls longer than ``SLOW_STEP``), bytes
sent per peer per token (the hosts' ``eth0`` counters: everything on the wire, DHT included; also counted after
every peer's first round, without the start-up), the wall time to reach ``--target-ratio`` x its baseline's final
loss (``baseline_for``: the DDP run of the same optimizer steps per token), and where each peer's time went (compute
/ ``step()`` / evaluation). The curves go to ``benchmarks/results/lm_<rate>.png`` (loss vs tokens and vs wall
time); the load average of the shared machine is recorded beside each run.

    python benchmarks/lm.py         # both links (FAST_LINK_SYSTEMS at 1 Gbit/s, SYSTEMS at 100 Mbit/s); ~55 min loaded
    python benchmarks/lm.py --rates 100mbit --systems ddp@64 swarm_opt/diloco32/int8 --steps 32   # a quick look
    python benchmarks/lm.py --report benchmarks/results/lm.json        # the tables and plots of a saved run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from _common import (
    RESULTS_DIR,
    join_loopback_swarm,
    kill_all,
    launch,
    leftovers,
    link_hosts,
    require_test_hosts,
    table,
    tail,
    write_json,
)

PEERS = 4
#: the systems of the slow link (the DiLoCo family's goals are set at 100 Mbit/s)
SYSTEMS = [
    "ddp", "ddp@64", "swarm_opt/grad", "hivemind/local", "swarm_opt/diloco32/fp32", "swarm_opt/diloco32/fp16",
    "swarm_opt/diloco32/int8", "swarm_opt/diloco32/topk", "swarm_opt/diloco64/int8", "swarm_opt/grad/powersgd4",
]
#: the gradient-averaging family, on the fast link (its goals are set at 1 Gbit/s)
FAST_LINK_SYSTEMS = ["ddp", "hivemind/grad", "swarm_opt/grad", "swarm_opt/grad+overlap", "lane/grad",
                     "lane/grad+overlap"]


def parse_system(system: str) -> Tuple[str, str, str]:
    """``family/strategy[/codec][@global batch]`` -> its first three parts (``ddp`` -> ``("ddp", "grad", "fp32")``)."""
    parts = system.split("@")[0].split("/")
    if parts == ["ddp"]:
        return "ddp", "grad", "fp32"
    if len(parts) not in (2, 3) or parts[0] not in ("hivemind", "swarm_opt", "lane"):
        raise SystemExit(f"unknown system {system!r}: use ddp or FAMILY/STRATEGY[/CODEC][@GLOBAL_BATCH], e.g. "
                         f"{SYSTEMS[-1]}")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else "fp32"


def steps_per_round(system: str, args: argparse.Namespace) -> int:
    """Local steps of each peer between two rounds: DiLoCo's H, hivemind/local's ``--local-h``, gradient averaging's
    micro-steps per global batch (``--global-batch``, or the system's ``@GLOBAL_BATCH``)."""
    _, strategy, _ = parse_system(system)
    if strategy.startswith("diloco"):
        return int(strategy[len("diloco"):].split("+")[0])
    if strategy == "local":
        return args.local_h
    global_batch = int(system.split("@")[1]) if "@" in system else args.global_batch
    if global_batch % (PEERS * args.batch):
        raise SystemExit(f"{system}: a global batch of {global_batch} is not a multiple of {PEERS} peers x "
                         f"{args.batch} sequences")
    return global_batch // (PEERS * args.batch)


def is_local(strategy: str) -> bool:
    """Whether the strategy's peers step on their own gradients (the inner LR follows the local step)."""
    return strategy == "local" or strategy.startswith("diloco")


# --- worker: one peer of one system ------------------------------------------------------------------------------
class ClippedAdamW:
    """What hivemind's ALBERT example does for clipping (``LambWithGradientClipping``): the optimizer clips the
    gradient it is about to apply, i.e. the averaged one with gradient averaging, the local one with local updates."""

    @staticmethod
    def make(params: Any, lr: float, max_norm: float) -> Any:
        import torch

        class _Clipped(torch.optim.AdamW):
            def step(self, closure: Any = None) -> Any:
                torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], max_norm)
                return super().step(closure)

        return _Clipped(params, lr=lr, betas=(0.9, 0.95))


def epoch_schedule(args: argparse.Namespace) -> Optional[Callable[[Any], Any]]:
    """Gradient averaging's scheduler factory: the LR factor of global step ``g`` is that of local step ``g x micro``
    (the same tokens), stepped on the global epoch so that every peer applies the same rate; None for local-update
    strategies, whose inner rate the loop sets at each local step."""
    import torch

    from swarm_opt.cli.language_model import FLOOR, WARMUP_EPOCHS, warmup_cosine

    if is_local(parse_system(args.system)[1]):
        return None
    micro, factor = steps_per_round(args.system, args), warmup_cosine(WARMUP_EPOCHS, args.steps, FLOOR)
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: factor(epoch * micro))


def make_swarm_optimizer(args: argparse.Namespace, dht: Any, model: Any, lr: float) -> Any:
    import torch

    import swarm_opt
    from swarm_opt.cli.language_model import decay_groups

    family, strategy, codec = parse_system(args.system)
    h = steps_per_round(args.system, args)
    overlap = swarm_opt.Overlap() if strategy.endswith("+overlap") else None
    if strategy.startswith("diloco"):
        algorithm = swarm_opt.DiLoCo(
            outer_optimizer=lambda p: torch.optim.SGD(p, lr=args.outer_lr, momentum=0.9, nesterov=True),
            overlap=overlap)
    elif strategy == "grad+overlap":
        algorithm = swarm_opt.GradientAveraging(overlap=overlap)
    else:
        algorithm = swarm_opt.GradientAveraging()
    codecs: Dict[str, Callable[[], Any]] = {
        "fp32": swarm_opt.NoCompression, "fp16": swarm_opt.Float16, "int8": swarm_opt.Int8Blockwise,
        "topk": lambda: swarm_opt.TopK(fraction=0.01), "powersgd4": lambda: swarm_opt.PowerSGD(rank=4)}
    return swarm_opt.Optimizer(
        dht=dht, run_id=f"lm_{args.tag}", target_batch_size=PEERS * h * args.batch, batch_size_per_step=args.batch,
        params=decay_groups(model), optimizer=lambda groups: torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95)),
        scheduler=epoch_schedule(args), strategy=algorithm, compression=codecs[codec](), clip_grad_norm=1.0,
        transport=swarm_opt.Gloo(host=args.host) if family == "lane" else None,
        matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout)


def make_hivemind_optimizer(args: argparse.Namespace, dht: Any, model: Any, lr: float) -> Any:
    import hivemind

    from swarm_opt.cli.language_model import decay_groups

    _, strategy, _ = parse_system(args.system)
    h = steps_per_round(args.system, args)
    return hivemind.Optimizer(
        dht=dht, run_id=f"lm_{args.tag}", target_batch_size=PEERS * h * args.batch, batch_size_per_step=args.batch,
        params=decay_groups(model), optimizer=lambda groups: ClippedAdamW.make(groups, lr, 1.0),
        scheduler=epoch_schedule(args), use_local_updates=strategy == "local",
        matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout, verbose=False)


def evaluate(model: Any, held_out: Any, windows: int, precision: str) -> float:
    """Mean next-byte loss over ``windows`` windows spread evenly over the held-out set (all 512 at the end)."""
    import torch

    from swarm_opt.cli.language_model import lm_loss

    stride = max(1, len(held_out) // windows)
    x, y = held_out.x[::stride][:windows], held_out.y[::stride][:windows]
    model.eval()
    total = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        for i in range(0, len(x), 64):
            total += float(lm_loss(model(x[i:i + 64]), y[i:i + 64])) * len(x[i:i + 64])
    model.train()
    return total / len(x)


#: a ``step()`` longer than this (seconds) is listed in a peer's result with its local step and epoch
SLOW_STEP = 0.1


def watch_inner_steps(inner: Any, total: List[float]) -> None:
    """Add the seconds of each step of ``inner`` (the optimizer a swarm optimizer steps locally) to ``total[0]``: the
    optimizer's own compute, which utilization counts beside forward and backward."""
    began: List[float] = []
    inner.register_step_pre_hook(lambda *_: began.append(time.perf_counter()))

    def ended(*_: Any) -> None:
        if began:
            total[0] += time.perf_counter() - began.pop()

    inner.register_step_post_hook(ended)


def worker(args: argparse.Namespace) -> None:
    import contextlib
    import logging

    import torch

    from swarm_opt.cli.language_model import FLOOR, TRAINING, WARMUP_EPOCHS, language_model, lm_loss, warmup_cosine
    from swarm_opt.recipe import DataShard

    logging.basicConfig(level=logging.WARNING, format=f"[rank {args.rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    workdir = Path(args.workdir)
    family, strategy, _ = parse_system(args.system)
    torch.manual_seed(args.seed)  # the same initial weights on every peer
    recipe = language_model(args.size)
    model, held_out = recipe.model, recipe.evaluation.data
    lr = TRAINING[args.size][0] * (args.inner_lr_scale if is_local(strategy) else 1.0)
    schedule = warmup_cosine(WARMUP_EPOCHS, args.steps, FLOOR)
    stream = iter(recipe.train_data(DataShard(args.rank, PEERS, args.seed)))
    micro = steps_per_round(args.system, args)

    dht, opt, ddp = None, None, None
    if family == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from swarm_opt.cli.language_model import decay_groups

        dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                                world_size=PEERS)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(decay_groups(model), lr=lr, betas=(0.9, 0.95))
        epoch: Callable[[], int] = lambda: syncs  # noqa: E731 (DDP's global steps)
    else:
        dht = join_loopback_swarm(workdir, args.rank, timeout=120, host=args.host)
        make = make_hivemind_optimizer if family == "hivemind" else make_swarm_optimizer
        opt = make(args, dht, model, lr)
        epoch = lambda: opt.local_epoch  # noqa: E731
    net = ddp if ddp is not None else model
    inner_stepping = [0.0]  # seconds in the inner optimizer's own steps (compute, not communication)
    if ddp is None:
        watch_inner_steps(opt.inner if family == "swarm_opt" else opt.state_averager.optimizer, inner_stepping)

    (workdir / f"ready{args.rank}").touch()
    deadline = time.monotonic() + 300
    while not (workdir / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.perf_counter()
    evaluating = computing = stepping = sync_compute = 0.0
    syncs, curve, first_round, first_round_step, slow_steps = 0, [], None, None, []
    local_steps = is_local(strategy)

    def record(step: int, windows: int) -> None:
        nonlocal evaluating
        began = time.perf_counter()
        loss = evaluate(model, held_out, windows, args.precision)
        curve.append(dict(step=step, seconds=began - start - evaluating, loss=loss, epoch=epoch()))
        evaluating += time.perf_counter() - began

    if args.rank == 0:
        record(0, args.eval_windows)
    # DDP runs exactly --steps steps; a swarm's peers step until the swarm has made its rounds (the same global steps
    # or rounds), so that nobody leaves a round early: how many tokens that took is counted, not fixed
    last_epoch = args.steps // micro
    k = 0
    while (k < args.steps) if ddp is not None else (epoch() < last_epoch and k < 3 * args.steps):
        began = time.perf_counter()
        x, y = (torch.stack(t) for t in zip(*(next(stream) for _ in range(args.batch))))
        sync = ddp is not None and (k + 1) % micro == 0
        with (contextlib.nullcontext() if ddp is None or sync else ddp.no_sync()):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss = lm_loss(net(x), y)
            (loss / micro if ddp is not None else loss).backward()
        spent = time.perf_counter() - began
        if sync:
            sync_compute, syncs = sync_compute + spent, syncs + 1
        else:
            computing += spent
        if local_steps or sync:  # local steps, or DDP's global step g = (k + 1) / micro - 1
            for group in opt.param_groups:
                group["lr"] = lr * schedule(min(k, args.steps - 1) if local_steps else k + 1 - micro)
        stepped, before = time.perf_counter(), epoch()
        if ddp is None:
            opt.step()
            opt.zero_grad()
        elif sync:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            inner_stepping[0] += time.perf_counter() - stepped
            opt.zero_grad()
        step_seconds = time.perf_counter() - stepped
        stepping += step_seconds
        if step_seconds > SLOW_STEP and len(slow_steps) < 400:
            slow_steps.append((k, round(step_seconds, 3), epoch()))
        k += 1
        if epoch() != before and first_round is None:  # the orchestrator counts the bytes sent from here too
            first_round, first_round_step = time.perf_counter() - start - evaluating, k
            (workdir / f"round{args.rank}").touch()
        if args.rank == 0 and epoch() < last_epoch:
            due = epoch() != before if local_steps else (k % args.eval_every == 0 and ddp is not None) or (
                ddp is None and epoch() != before and epoch() % max(1, args.eval_every // micro) == 0)
            if due:
                record(k, args.eval_windows)
    wall = time.perf_counter() - start - evaluating
    if args.rank == 0:
        record(k, len(held_out))
    if ddp is not None:  # the synchronising steps' backward waits for the all-reduce: count a no_sync step's compute
        per_step = computing / max(1, k - syncs)
        compute_total = computing + syncs * per_step
    else:
        compute_total = computing
    result = dict(rank=args.rank, system=args.system, steps=k, wall=wall, computing=compute_total, stepping=stepping,
                  evaluating=evaluating, sync_step_seconds=sync_compute, epoch=epoch(), first_round=first_round,
                  first_round_step=first_round_step,
                  utilization=compute_total / wall, inner_stepping=inner_stepping[0], slow_steps=slow_steps,
                  curve=curve, loadavg=os.getloadavg(),
                  lane_rounds=getattr(getattr(opt, "_averager", None), "lane_rounds", None))
    (workdir / f"result{args.rank}.json").write_text(json.dumps(result))
    while not (workdir / "stop").exists():  # stay until every peer is done: a leaving peer stalls the others
        time.sleep(0.05)
    if ddp is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    else:
        opt.shutdown()
        dht.shutdown()


# --- orchestrator --------------------------------------------------------------------------------------------------
def tx_bytes(hosts: Any) -> List[int]:
    """Bytes each host has sent on its link (its ``eth0`` counter)."""
    counts = []
    for name in hosts.names:
        out = subprocess.run(["ip", "-n", name, "-j", "-s", "link", "show", "eth0"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        counts.append(int(json.loads(out)[0]["stats64"]["tx"]["bytes"]))
    return counts


def free_port() -> int:
    import random

    return random.randrange(20000, 60000)


def run_system(args: argparse.Namespace, hosts: Any, system: str, seed: int) -> Dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="swarm_lm_"))
    logs = [workdir / f"worker{r}.log" for r in range(PEERS)]
    procs = []
    load_before = os.getloadavg()
    port = free_port()
    try:
        for rank in range(PEERS):
            worker_args = [str(Path(__file__).resolve()), "--worker", "--rank", str(rank), "--workdir", str(workdir),
                           "--host", hosts.address(rank), "--master", hosts.address(0), "--port", str(port),
                           "--system", system, "--seed", str(seed), "--tag", f"{seed}_{port}", *args.passthrough]
            procs.append(launch(worker_args, logs[rank], {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"},
                                prefix=hosts.prefix(rank)))
        deadline = time.monotonic() + 300
        while not all((workdir / f"ready{r}").exists() for r in range(PEERS)):
            for proc, log in zip(procs, logs):
                if proc.poll() is not None:
                    raise RuntimeError(f"a worker exited early:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not start in 300 s:\n" + "\n".join(tail(log, 10) for log in logs))
            time.sleep(0.1)
        sent_before = tx_bytes(hosts)
        (workdir / "go").touch()
        deadline, sent_at_first_round = time.monotonic() + args.max_seconds, None
        while not all((workdir / f"result{r}.json").exists() for r in range(PEERS)):
            if sent_at_first_round is None and all((workdir / f"round{r}").exists() for r in range(PEERS)):
                sent_at_first_round = tx_bytes(hosts)  # start-up (state downloads, the DHT) is behind us
            for proc, log in zip(procs, logs):
                if proc.poll() is not None:
                    raise RuntimeError(f"a worker exited ({proc.returncode}):\n{tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not finish:\n" + "\n".join(tail(log, 10) for log in logs))
            time.sleep(0.2)
        sent_at_end = tx_bytes(hosts)
        sent = [after - before for after, before in zip(sent_at_end, sent_before)]
        steady = [after - before for after, before in zip(sent_at_end, sent_at_first_round)] \
            if sent_at_first_round else None
        (workdir / "stop").touch()
        peers = [json.loads((workdir / f"result{r}.json").read_text()) for r in range(PEERS)]
        noisy = [r for r, log in enumerate(logs) if "Traceback" in log.read_text(errors="replace")]
        return dict(system=system, seed=seed, peers=peers, bytes_sent=sent, bytes_after_first_round=steady,
                    tracebacks_in_logs=noisy,
                    loadavg_before=load_before, loadavg_after=os.getloadavg())
    except RuntimeError as e:
        return dict(system=system, seed=seed, failed=str(e)[-3000:], loadavg_before=load_before)
    finally:
        time.sleep(1.0)
        kill_all(procs)
        left = leftovers(procs)
        if left:
            print(f"  warning: leftover processes {left}", file=sys.stderr)
        kept = RESULTS_DIR / "lm_logs" / f"{hosts.rate}_{system.replace('/', '_')}_seed{seed}"
        kept.mkdir(parents=True, exist_ok=True)
        for log in logs:  # kept for diagnosis (results/ is not committed)
            if log.exists():
                shutil.copy(log, kept / log.name)
        shutil.rmtree(workdir, ignore_errors=True)


def summary(run: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    """One run's numbers: final loss (rank 0), tokens/s (slowest peer), utilization and bytes (mean of peers)."""
    if "failed" in run:
        return dict(system=run["system"], failed=True)
    peers = run["peers"]
    tokens = sum(p["steps"] for p in peers) * args.batch * args.context  # the whole swarm's tokens
    wall = max(p["wall"] for p in peers)
    final = peers[0]["curve"][-1]["loss"]
    rounds = peers[0]["epoch"]
    per_round = tokens / rounds / (steps_per_round(run["system"], args) * PEERS * args.batch * args.context) \
        if rounds else float("nan")
    return dict(system=run["system"], loss=final, perplexity=math.exp(final), tokens_per_s=tokens / wall, wall=wall,
                utilization=sum(p["utilization"] for p in peers) / PEERS,
                utilization_with_steps=sum(p["utilization"] + p.get("inner_stepping", 0.0) / p["wall"]
                                           for p in peers) / PEERS,
                bytes_per_peer_token=sum(run["bytes_sent"]) / tokens, tokens=tokens,
                steady_bytes_per_peer_token=steady_bytes(run, args),
                tokens_vs_budget=tokens / (args.steps * args.batch * args.context * PEERS),
                compute=sum(p["computing"] for p in peers) / PEERS,
                stepping=sum(p["stepping"] for p in peers) / PEERS, rounds=rounds, samples_per_round=per_round,
                first_round=peers[0]["first_round"], load=run["loadavg_before"][0],
                curve=curve_tokens(run, args), tracebacks=run["tracebacks_in_logs"])


def steady_bytes(run: Dict[str, Any], args: argparse.Namespace) -> Optional[float]:
    """Bytes per token after every peer's first round: the rounds' cost without the start-up's (the DHT's joining,
    a newcomer's state download), which a run of a few minutes cannot amortise."""
    peers = run["peers"]
    after = sum(p["steps"] - (p["first_round_step"] or 0) for p in peers) * args.batch * args.context
    if not run.get("bytes_after_first_round") or after <= 0:
        return None
    return sum(run["bytes_after_first_round"]) / after


def curve_tokens(run: Dict[str, Any], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Rank 0's evaluations with the swarm's tokens at each: rank 0's local steps x 4 peers (they run at about the
    same speed), and at the end the swarm's count."""
    peers, per_step = run["peers"], args.batch * args.context
    points = [dict(point, tokens=point["step"] * PEERS * per_step) for point in peers[0]["curve"]]
    points[-1]["tokens"] = sum(p["steps"] for p in peers) * per_step
    return points


def time_to(curve: List[Dict[str, Any]], target: float) -> Optional[float]:
    for point in curve:
        if point["loss"] <= target:
            return point["seconds"]
    return None


def estimate_synchronous_compute(runs: List[Dict[str, Any]]) -> None:
    """A DDP run that all-reduces at every step (``ddp@64``) has no ``no_sync`` step whose time is pure compute: give
    it the compute per step of the same rate's DDP run with accumulation (same model, batch and load), marked
    ``estimated_compute``."""
    timed = [p["computing"] / p["steps"] for run in runs if "failed" not in run and run["system"].startswith("ddp")
             for p in run["peers"] if p["computing"] > 0]
    if not timed:
        return
    per_step = sum(timed) / len(timed)
    for run in runs:
        if "failed" not in run and run["system"].startswith("ddp") and all(p["computing"] == 0 for p in run["peers"]):
            run["estimated_compute"] = True
            for p in run["peers"]:
                p["computing"] = per_step * p["steps"]
                p["utilization"] = p["computing"] / p["wall"]


def baseline_for(system: str, args: argparse.Namespace) -> str:
    """The DDP run a system is compared with: the same optimizer steps per token. Gradient averaging over a global
    batch B: DDP over B; local-update strategies (an inner step per local batch): DDP over one local batch of every
    peer (``ddp@PEERSxBATCH``), if that ran."""
    _, strategy, _ = parse_system(system)
    if is_local(strategy):
        return f"ddp@{PEERS * args.batch}"
    return f"ddp@{system.split('@')[1]}" if "@" in system else "ddp"


def report(runs: List[Dict[str, Any]], args: argparse.Namespace) -> Tuple[str, Dict[str, Any]]:
    """The table of one link rate: every system against the DDP run of the same optimizer steps per token (its
    baseline, ``baseline_for``; plain ``ddp`` if that did not run), measured in the same run."""
    rows, ratios = [], {}
    estimate_synchronous_compute(runs)
    done = {s["system"]: s for s in (summary(r, args) for r in runs) if not s.get("failed")}
    for run in runs:
        s = summary(run, args)
        if s.get("failed"):
            rows.append([run["system"], "failed", *["-"] * 13])
            continue
        name = baseline_for(s["system"], args)
        base = done.get(name) or done.get("ddp")
        reach = time_to(s["curve"], base["loss"] * args.target_ratio) if base else None
        steady = s["steady_bytes_per_peer_token"]  # DDP has no start-up transfers: its steady bytes are all of them
        base_steady = base and (base["steady_bytes_per_peer_token"] or base["bytes_per_peer_token"])
        vs = dict(baseline=base["system"], loss=s["loss"] / base["loss"],
                  tokens_per_s=s["tokens_per_s"] / base["tokens_per_s"],
                  fewer_bytes=base["bytes_per_peer_token"] / s["bytes_per_peer_token"],
                  fewer_bytes_steady=base_steady / steady if steady and base_steady else None) if base else {}
        ratios[s["system"]] = dict(vs, time_to_target=reach, **{k: v for k, v in s.items() if k != "curve"})
        rows.append([
            s["system"], f"{s['loss']:.4f}", f"{s['perplexity']:.2f}", vs.get("baseline", "-"),
            f"{100 * (vs['loss'] - 1):+.2f} %" if base else "-",
            f"{s['tokens_per_s']:,.0f}", f"{vs['tokens_per_s']:.2f}x" if base else "-",
            f"{100 * s['utilization']:.1f} % ({100 * s['utilization_with_steps']:.1f} %)"
            if s["utilization"] > 0 else "- (no ddp run to estimate it from)",
            f"{s['bytes_per_peer_token']:.0f}" + (f" ({steady:.0f})" if steady is not None else ""),
            (f"{vs['fewer_bytes']:.1f}x" + (f" ({vs['fewer_bytes_steady']:.1f}x)" if vs["fewer_bytes_steady"] else ""))
            if base else "-", f"{reach:.0f} s" if reach is not None else "not reached",
            f"{s['tokens_vs_budget']:.2f}x",
            f"{s['compute']:.0f} / {s['stepping']:.0f}", f"{s['rounds']} ({s['samples_per_round']:.2f}x)",
            f"{s['load']:.1f}"])
    headers = ["system", "val loss", "ppl", "baseline", "loss vs baseline", "tokens/s", "vs baseline",
               "compute util. (with optimizer steps)", "bytes/peer/token (after 1st round)",
               "fewer bytes (after 1st round)",
               f"time to {args.target_ratio:g}x baseline loss", "tokens vs budget", "s compute / s in step()",
               "rounds (samples per round vs target)", "load (1 min)"]
    return table(headers, rows), ratios


def plot(rate: str, runs: List[Dict[str, Any]], args: argparse.Namespace) -> Optional[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(13, 5))
    for run in runs:
        if "failed" in run:
            continue
        curve = curve_tokens(run, args)
        label = f"{run['system']} (seed {run['seed']})" if len(args.seeds) > 1 else run["system"]
        style = "--" if run["system"].startswith("hivemind") else (":" if run["system"] == "ddp" else "-")
        by_tokens.plot([p["tokens"] / 1e6 for p in curve], [p["loss"] for p in curve], style,
                       marker=".", label=label)
        by_time.plot([p["seconds"] for p in curve], [p["loss"] for p in curve], style, marker=".", label=label)
    by_tokens.set(xlabel="tokens (millions, whole swarm)", ylabel="validation loss (nats/byte)",
                  title=f"lm-{args.size}, 4 peers, {rate} links")
    by_time.set(xlabel="wall seconds (evaluations excluded)", ylabel="validation loss", title="the same runs vs time")
    for axis in (by_tokens, by_time):
        axis.set_ylim(top=min(4.0, axis.get_ylim()[1]))
        axis.grid(alpha=0.3)
    by_time.legend(fontsize=7)
    path = RESULTS_DIR / f"lm_{rate}.png"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for hidden in ("--rank", "--workdir", "--host", "--master", "--port", "--system", "--seed", "--tag"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS)
    parser.add_argument("--fast-systems", nargs="+", default=FAST_LINK_SYSTEMS,
                        help="the systems run on the first of several --rates (the others run --systems)")
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"], help="tc tbf rates, fast first")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small", "medium", "large"])
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                        help="the forward pass's (the recipe's bf16; fp32 where the CPU has no native bfloat16: "
                             "emulated, bf16 is ~10x slower there)")
    parser.add_argument("--steps", type=int, default=64, help="local steps of each peer (the token budget)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per local step")
    parser.add_argument("--global-batch", type=int, default=256, help="sequences per global step (DDP, grad avg.)")
    parser.add_argument("--local-h", type=int, default=32, help="local steps per round of hivemind/local")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer Nesterov SGD's lr")
    parser.add_argument("--inner-lr-scale", type=float, default=1.0,
                        help="the local-update systems' (DiLoCo, hivemind/local) peak lr: a multiple of the recipe's")
    parser.add_argument("--eval-every", type=int, default=16, help="local steps between evaluations (rank 0)")
    parser.add_argument("--eval-windows", type=int, default=128, help="held-out windows per curve point")
    parser.add_argument("--target-ratio", type=float, default=1.02, help="the target loss, as a multiple of DDP's")
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    parser.add_argument("--max-seconds", type=float, default=900.0, help="one run's time limit")
    parser.add_argument("--out", default="lm.json", help="the JSON's name under benchmarks/results/")
    parser.add_argument("--report", help="print the tables and plots of a saved JSON (e.g. a run cut short)")
    args = parser.parse_args()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        for key, value in saved["args"].items():
            setattr(args, key, value)
        print_report(saved["rates"], args)
        return
    args.passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
        "size", "precision", "steps", "batch", "global_batch", "local_h", "outer_lr", "inner_lr_scale", "eval_every",
        "eval_windows", "matchmaking_time", "averaging_timeout")]
    args.context = {"tiny": 64, "small": 128, "medium": 256, "large": 256}[args.size]
    if args.worker:
        for name in ("rank", "port", "seed"):
            setattr(args, name, int(getattr(args, name)))
        worker(args)
        return
    for system in args.systems:
        if args.steps % steps_per_round(system, args):
            raise SystemExit(f"--steps {args.steps} is not a multiple of {system}'s "
                             f"{steps_per_round(system, args)} local steps per round: the last round would "
                             f"be cut, and the tokens would differ")

    require_test_hosts()
    started, results = time.time(), {}
    for i, rate in enumerate(args.rates):
        chosen = args.fast_systems if i == 0 and len(args.rates) > 1 else args.systems
        hosts = link_hosts(PEERS, rate)
        hosts.rate = rate
        try:
            link = hosts.measure_link()
            print(f"{PEERS} hosts, links limited to {rate}: one TCP stream measured at {link:.1f} Mbit/s", flush=True)
            results[rate] = dict(link_mbit_s=link, runs=[])
            for seed in args.seeds:
                for system in chosen:
                    t0 = time.time()
                    run = run_system(args, hosts, system, seed)
                    results[rate]["runs"].append(run)
                    s = summary(run, args)
                    print(f"  {rate} {system} seed {seed}: " + ("FAILED " + run["failed"][-400:] if s.get("failed")
                          else f"loss {s['loss']:.4f}, {s['tokens_per_s']:,.0f} tokens/s, "
                               f"util {100 * s['utilization']:.0f} %, {s['bytes_per_peer_token']:.1f} B/peer/token")
                          + f", {time.time() - t0:.0f} s, load {run['loadavg_before'][0]:.1f}", flush=True)
                    write_json(args.out, dict(args=settings(args), rates=results, seconds=time.time() - started))
        finally:
            hosts.close()
    print_report(results, args)


def settings(args: argparse.Namespace) -> Dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("passthrough", "report")}


def print_report(results: Dict[str, Any], args: argparse.Namespace) -> None:
    """The tables and plots of every link rate, from the runs (also ``--report FILE``: from a saved JSON)."""
    for rate, measured in results.items():
        text, ratios = report(measured["runs"], args)
        measured["summary"] = ratios
        png = plot(rate, measured["runs"], args)
        print(f"\n{rate} links ({measured['link_mbit_s']:.0f} Mbit/s measured), lm-{args.size}, {PEERS} peers x "
              f"{args.steps} local steps x {args.batch} sequences x {args.context} bytes "
              f"({args.steps * args.batch * args.context * PEERS / 1e6:.2f}M tokens), global batch "
              f"{args.global_batch}, seeds {args.seeds}; curves: {png}\n{text}")
    if not args.report:
        path = write_json(args.out, dict(args=settings(args), rates=results))
        print(f"wrote {path}\nreproduce: python benchmarks/lm.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
