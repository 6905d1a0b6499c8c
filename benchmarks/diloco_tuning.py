"""Which DiLoCo settings bring DiLoCo within 2 % of ``ddp@64`` on ``lm-tiny`` at equal tokens, and how much each
matters.

A single-process simulation of ``lm.py``'s four peers (no network, no ``swarm_opt.Optimizer``: plain torch, the maths
swarm_opt's DiLoCo does with every peer making exactly H inner steps per round): the same model seed, data shards,
batch order, recipe (AdamW 0.9/0.95, weight decay on matrices, clipping at 1.0, bf16 autocast, warmup then cosine per
local step) and held-out evaluation (all 512 windows, ``lm.evaluate``). It runs ``ddp@64`` (one step per local batch
of every peer, on their mean gradient) and DiLoCo over H, the outer SGD's lr / momentum / Nesterov, the inner peak lr
(a multiple of the recipe's) and, as an ablation, averaging the inner AdamW state with the parameters.

    python benchmarks/diloco_tuning.py --steps 500                   # ddp@64 and DiLoCo as lm.py runs it (H 50, 0.7)
    python benchmarks/diloco_tuning.py --sweep grid                  # 500 steps: outer lr x inner lr x H
    python benchmarks/diloco_tuning.py --sweep long                  # 2000 steps: ddp@64 and the grid's best two
    python benchmarks/diloco_tuning.py --steps 500 --h 25 --outer-lr 1.0 --inner-lr-scale 2 --no-ddp
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from _common import RESULTS_DIR, table, write_json
from lm import PEERS, evaluate

from swarm_opt.cli.language_model import (  # (_common put the repository on sys.path)
    FLOOR,
    TRAINING,
    WARMUP_EPOCHS,
    decay_groups,
    language_model,
    lm_loss,
    warmup_cosine,
)
from swarm_opt.recipe import DataShard

SIZE, BATCH = "tiny", 16
#: the 500-step grid of ``--sweep grid`` (the brief's): outer lr x inner peak lr scale x H, Nesterov momentum 0.9
GRID = dict(outer_lr=[0.5, 0.7, 1.0, 1.4], inner_lr_scale=[1.0, 2.0], h=[25, 50])
#: measured by lm.py on a quiet machine (benchmarks/README.md, "DiLoCo with more rounds"): steps -> (ddp@64, DiLoCo
#: fp32 H = 50 outer lr 0.7); DiLoCo's own run-to-run spread at 500 steps was 2.0519 / 2.0760 / 2.0969
MEASURED = {500: (1.8925, 2.0519), 2000: (1.3376, 1.4248)}


def config_name(cfg: Dict[str, Any]) -> str:
    if cfg["kind"] == "ddp":
        return "ddp@64" + (f" lr x{cfg['inner_lr_scale']:g}" if cfg["inner_lr_scale"] != 1 else "")
    name = (f"diloco H={cfg['h']} outer lr {cfg['outer_lr']:g} m {cfg['outer_momentum']:g}"
            f"{' nesterov' if cfg['nesterov'] else ''} inner lr x{cfg['inner_lr_scale']:g}")
    return name + (" +avg AdamW state" if cfg["average_adam"] else "")


def setup(seed: int) -> Tuple[torch.nn.Module, Any, List[Iterator[Tuple[torch.Tensor, torch.Tensor]]]]:
    """What each of lm.py's workers builds: the model after ``torch.manual_seed(seed)`` (the same on every peer), the
    held-out set, and each rank's stream of its shard (``DataShard(rank, PEERS, seed)``)."""
    torch.manual_seed(seed)
    recipe = language_model(SIZE)
    streams = [iter(recipe.train_data(DataShard(rank, PEERS, seed))) for rank in range(PEERS)]
    return recipe.model, recipe.evaluation.data, streams


def next_batch(stream: Iterator[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    x, y = (torch.stack(t) for t in zip(*(next(stream) for _ in range(BATCH))))
    return x, y


def backward(model: torch.nn.Module, batch: Tuple[torch.Tensor, torch.Tensor], bf16: bool, scale: float = 1.0) -> None:
    """A training forward and backward: bf16 autocast as lm.py's (``bf16``), or fp32."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = lm_loss(model(batch[0]), batch[1])
    (loss * scale).backward()


def run(cfg: Dict[str, Any], steps: int, seed: int, eval_every: int, eval_windows: int, bf16: bool,
        eval_precision: str) -> Dict[str, Any]:
    """One run: validation loss on all held-out windows at the end, a curve of ``eval_windows`` on the way (lm.py's
    ``evaluate``, in ``eval_precision``)."""
    model, held_out, streams = setup(seed)
    peak = TRAINING[SIZE][0] * cfg["inner_lr_scale"]
    schedule = warmup_cosine(WARMUP_EPOCHS, steps, FLOOR)
    started, evaluating, curve = time.perf_counter(), 0.0, []

    def record(step: int, net: torch.nn.Module) -> None:
        nonlocal evaluating
        began = time.perf_counter()
        curve.append(dict(step=step, loss=evaluate(net, held_out, eval_windows, eval_precision)))
        evaluating += time.perf_counter() - began

    if cfg["kind"] == "ddp":
        # DDP over gloo: each rank's backward of its own batch, the gradients averaged (the all-reduce), clipped,
        # then one AdamW step at lr x schedule(k) (lm.py's ``k + 1 - micro`` with micro = 1)
        opt = torch.optim.AdamW(decay_groups(model), lr=peak, betas=(0.9, 0.95))
        for k in range(steps):
            for stream in streams:
                backward(model, next_batch(stream), bf16, 1.0 / PEERS)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for group in opt.param_groups:
                group["lr"] = peak * schedule(k)
            opt.step()
            opt.zero_grad()
            if (k + 1) % eval_every == 0 and k + 1 < steps:
                record(k + 1, model)
        final = model
    else:
        h = cfg["h"]
        replicas = [copy.deepcopy(model) for _ in range(PEERS)]
        inner = [torch.optim.AdamW(decay_groups(m), lr=peak, betas=(0.9, 0.95)) for m in replicas]
        params = [[p for g in opt.param_groups for p in g["params"]] for opt in inner]  # the anchor's order
        anchor = [p.detach().clone() for p in params[0]]  # x, fp32
        outer = torch.optim.SGD(anchor, lr=cfg["outer_lr"], momentum=cfg["outer_momentum"], nesterov=cfg["nesterov"])
        for k in range(steps):
            # a peer's local step k: its own batch, clipping, AdamW at the recipe's factor of local step k
            for stream, m, opt in zip(streams, replicas, inner):
                backward(m, next_batch(stream), bf16)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                for group in opt.param_groups:
                    group["lr"] = peak * schedule(k)
                opt.step()
                opt.zero_grad()
            if (k + 1) % h:
                continue
            with torch.no_grad():  # the round: ybar, the outer step on x - ybar from x, every peer restarts at x
                for j, x in enumerate(anchor):
                    ybar = torch.stack([ps[j].detach() for ps in params]).mean(0)
                    x.grad = x - ybar
                outer.step()
                outer.zero_grad(set_to_none=True)
                for ps in params:
                    for p, x in zip(ps, anchor):
                        p.copy_(x)
                if cfg["average_adam"]:  # ablation: the inner AdamW moments averaged too (same step counts)
                    for j in range(len(anchor)):
                        states = [opt.state[ps[j]] for opt, ps in zip(inner, params)]
                        for key in ("exp_avg", "exp_avg_sq"):
                            mean = torch.stack([s[key] for s in states]).mean(0)
                            for s in states:
                                s[key].copy_(mean)
            if (k + 1) % eval_every == 0 and k + 1 < steps:
                record(k + 1, replicas[0])
        final = replicas[0]  # holds x after the last round (steps is a multiple of H)
    wall = time.perf_counter() - started - evaluating
    began = time.perf_counter()
    loss = evaluate(final, held_out, len(held_out), eval_precision)
    curve.append(dict(step=steps, loss=loss))
    return dict(config=cfg, name=config_name(cfg), steps=steps, seed=seed, precision="bf16" if bf16 else "fp32",
                eval_precision=eval_precision,
                loss=loss, curve=curve,
                train_seconds=wall, seconds=time.perf_counter() - started, eval_seconds=evaluating +
                time.perf_counter() - began)


def configs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """DiLoCo's configurations: the product of the options' lists."""
    out = []
    for h, outer_lr, scale, momentum, average in itertools.product(
            args.h, args.outer_lr, args.inner_lr_scale, args.outer_momentum, args.average_adam):
        if args.steps % h:
            raise SystemExit(f"--steps {args.steps} is not a multiple of H = {h}: the last round would be cut")
        out.append(dict(kind="diloco", h=h, outer_lr=outer_lr, inner_lr_scale=scale, outer_momentum=momentum,
                        nesterov=not args.no_nesterov and momentum > 0, average_adam=average))
    return out


def best_of(path: Path, count: int) -> List[Dict[str, Any]]:
    """The ``count`` DiLoCo configurations of lowest loss in a saved run (``--sweep long``)."""
    saved = json.loads(path.read_text())
    runs = sorted((r for r in saved["runs"] if r["config"]["kind"] == "diloco"), key=lambda r: r["loss"])
    return [r["config"] for r in runs[:count]]


def key(cfg: Dict[str, Any], steps: int, seed: int, precision: str, eval_precision: str) -> str:
    return json.dumps([cfg, steps, seed, precision, eval_precision], sort_keys=True)


def key_of(r: Dict[str, Any]) -> str:
    return key(r["config"], r["steps"], r["seed"], r["precision"], r.get("eval_precision", "bf16"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500, help="local steps of each peer (the token budget)")
    parser.add_argument("--h", type=int, nargs="+", default=[50], help="inner steps per round")
    parser.add_argument("--outer-lr", type=float, nargs="+", default=[0.7])
    parser.add_argument("--outer-momentum", type=float, nargs="+", default=[0.9])
    parser.add_argument("--no-nesterov", action="store_true", help="plain momentum in the outer SGD")
    parser.add_argument("--inner-lr-scale", type=float, nargs="+", default=[1.0],
                        help="the inner peak lr, as a multiple of the recipe's 1e-3")
    parser.add_argument("--average-adam", type=int, nargs="+", default=[0], choices=[0, 1],
                        help="1: average the inner AdamW moments at every round too (an ablation)")
    parser.add_argument("--ddp-lr-scale", type=float, nargs="+", default=[1.0],
                        help="the ddp@64 baselines' peak lr multiples (the first is the one compared with)")
    parser.add_argument("--no-ddp", action="store_true", help="skip ddp@64 (the %% column then uses --reuse's)")
    parser.add_argument("--sweep", choices=["grid", "long"],
                        help="grid: 500 steps, outer lr x inner lr scale x H (GRID); long: 2000 steps, ddp@64 and "
                             "the best --best configurations of --from")
    parser.add_argument("--from", dest="source", default=str(RESULTS_DIR / "diloco_tuning_grid.json"),
                        help="--sweep long: the grid's JSON")
    parser.add_argument("--best", type=int, default=2)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                        help="training's: lm.py's bf16 autocast, or fp32 (10x faster on a CPU without native bf16)")
    parser.add_argument("--eval-precision", choices=["bf16", "fp32"], default="bf16",
                        help="the evaluation's (lm.py's evaluate): bf16 as the measured runs evaluated")
    parser.add_argument("--seed", type=int, nargs="+", default=[0])
    parser.add_argument("--eval-every", type=int, default=100, help="local steps between curve points")
    parser.add_argument("--eval-windows", type=int, default=128, help="held-out windows per curve point")
    parser.add_argument("--reuse", nargs="*", default=[],
                        help="saved JSONs whose runs of the same configuration, steps and seed are taken, not rerun")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="print the tables of saved runs (several JSONs merged), running nothing")
    parser.add_argument("--out", default="diloco_tuning.json", help="the JSON's name under benchmarks/results/")
    args = parser.parse_args()
    if args.report:
        saved = {key_of(r): r for path in args.report for r in json.loads(Path(path).read_text())["runs"]}
        for steps in sorted({r["steps"] for r in saved.values()}):
            print(report([r for r in saved.values() if r["steps"] == steps], {}, steps))
        return
    torch.set_num_threads(1)
    if args.sweep == "grid":
        args.steps, args.h, args.outer_lr, args.inner_lr_scale = 500, GRID["h"], GRID["outer_lr"], \
            GRID["inner_lr_scale"]
        chosen = configs(args)
    elif args.sweep == "long":
        args.steps = 2000
        chosen = best_of(Path(args.source), args.best)
    else:
        chosen = configs(args)
    baselines = [] if args.no_ddp else [dict(kind="ddp", inner_lr_scale=s) for s in args.ddp_lr_scale]

    known: Dict[str, Dict[str, Any]] = {}
    for path in args.reuse:
        for r in json.loads(Path(path).read_text())["runs"]:
            known[key_of(r)] = r
    runs: List[Dict[str, Any]] = []
    started = time.time()
    for seed in args.seed:
        for cfg in baselines + chosen:
            done = known.get(key(cfg, args.steps, seed, args.precision, args.eval_precision))
            if done is None:
                done = run(cfg, args.steps, seed, args.eval_every, args.eval_windows, args.precision == "bf16",
                           args.eval_precision)
                took = f"{done['seconds']:.0f} s"
            else:
                took = "reused"
            runs.append(done)
            print(f"  {done['name']} seed {seed}: val loss {done['loss']:.4f} ({took})", flush=True)
            write_json(args.out, dict(args=vars(args), runs=runs, seconds=time.time() - started))
    print(report(runs, known, args.steps))
    path = write_json(args.out, dict(args=vars(args), runs=runs, seconds=time.time() - started,
                                     measured_by_lm_py=MEASURED.get(args.steps)))
    print(f"wrote {path} ({time.time() - started:.0f} s)\nreproduce: python benchmarks/diloco_tuning.py "
          f"{' '.join(sys.argv[1:])}".rstrip())


def report(runs: List[Dict[str, Any]], known: Dict[str, Dict[str, Any]], steps: int) -> str:
    """The table: each run against the ``ddp@64`` run (recipe lr) of the same steps and seed."""
    def baseline(seed: int, precision: str) -> Optional[float]:
        for r in list(runs) + list(known.values()):
            if (r["steps"], r["seed"], r["precision"]) == (steps, seed, precision) and \
                    r["config"] == dict(kind="ddp", inner_lr_scale=1.0):
                return r["loss"]
        return None

    rows = []
    for r in sorted(runs, key=lambda r: (r["seed"], r["config"]["kind"] != "ddp", r["loss"])):
        base = baseline(r["seed"], r["precision"])
        vs = f"{100 * (r['loss'] / base - 1):+.2f} %" if base else "-"
        rows.append([r["name"], r["seed"], r["precision"], f"{r['loss']:.4f}", vs, f"{r['train_seconds']:.0f}"])
    measured = MEASURED.get(steps)
    note = f"\nmeasured by lm.py at {steps} steps: ddp@64 {measured[0]}, DiLoCo H=50 outer lr 0.7 {measured[1]}" \
        if measured else ""
    return (f"\nlm-{SIZE}, {PEERS} peers x {steps} local steps x {BATCH} sequences (simulated)\n"
            + table(["config", "seed", "training", "val loss", "vs ddp@64", "s training"], rows) + note)


if __name__ == "__main__":
    main()
