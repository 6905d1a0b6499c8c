"""Cost of ``Optimizer.step()`` when no averaging round happens, against the bare inner optimizer step.

One peer, a ``target_batch_size`` so large that no round ever starts: what is left is the per-step bookkeeping
(gradient accumulation, progress reporting). Three things are timed on the same workload in the same process:

* ``inner``     -- ``inner.step()`` alone on a twin model (the baseline every ratio is taken against);
* ``swarm_opt`` -- ``swarm_opt.Optimizer.step()``;
* ``hivemind``  -- ``hivemind.Optimizer.step()`` with ``use_local_updates=False``;
* ``swarm_opt+metrics`` -- ``swarm_opt.Optimizer.step()`` with Prometheus metrics on (``serve_metrics``) and scraped
  every 0.5 s by a thread of the same process (Prometheus scrapes every 15 s by default): what monitoring costs a step.

Gradients are set once (a fake backward) so that only ``step()`` is timed. Each variant is timed in pairs with the
inner baseline (alternating order), while that variant's optimizer (and its background tracker thread) is alive, so
the ratio compares like with like. Neither swarm optimizer calls the inner optimizer on such a step: both only
accumulate gradients toward the global batch, so a ratio below 1 is possible and is not a free lunch.

    python benchmarks/step_overhead.py                       # ~200K and ~10M params, SGD(momentum) and Adam
    python benchmarks/step_overhead.py --models small --reps-small 5000
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
from typing import Callable, Dict, List

import torch
from _common import command_line, quantiles, table, write_json  # also puts the repo on sys.path for swarm_opt

MODELS: Dict[str, Callable[[], torch.nn.Module]] = {
    # 784*256+256 + 256*10+10 = 203,530 parameters
    "small": lambda: torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)),
    # 784*2800+2800 + 2800*2800+2800 + 2800*10+10 = 10,067,610 parameters
    "large": lambda: torch.nn.Sequential(torch.nn.Linear(784, 2800), torch.nn.ReLU(), torch.nn.Linear(2800, 2800),
                                         torch.nn.ReLU(), torch.nn.Linear(2800, 10)),
}
INNER = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
}
HUGE_TARGET = 10**12


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]()
    for p in model.parameters():  # the fake backward: gradients are set once and never change
        p.grad = torch.randn_like(p) * 1e-3
    return model


def timed_pairs(variant: Callable[[], None], baseline: Callable[[], None], reps: int, warmup: int):
    """Time ``reps`` pairs (variant, baseline), alternating which goes first, after ``warmup`` untimed pairs."""
    t_variant: List[float] = []
    t_base: List[float] = []
    for i in range(warmup + reps):
        order = ((variant, t_variant), (baseline, t_base)) if i % 2 else ((baseline, t_base), (variant, t_variant))
        for fn, sink in order:
            start = time.perf_counter_ns()
            fn()
            elapsed = (time.perf_counter_ns() - start) / 1e3  # microseconds
            if i >= warmup:
                sink.append(elapsed)
    return t_variant, t_base


def bench_config(model_name: str, inner_name: str, dht, reps: int, warmup: int, skip_hivemind: bool,
                 with_metrics: bool = True) -> dict:
    import hivemind

    import swarm_opt

    n_params = sum(p.numel() for p in make_model(model_name).parameters())
    twin = make_model(model_name)
    bare = INNER[inner_name](twin.parameters())
    bare.step()  # allocate momentum / Adam state before timing, as the swarm optimizers' inner ones will have it
    out = {"model": model_name, "params": n_params, "inner": inner_name, "reps": reps, "variants": {}}

    model = make_model(model_name)
    opt = swarm_opt.Optimizer(dht=dht, run_id=f"overhead_{model_name}_{inner_name}", target_batch_size=HUGE_TARGET,
                              batch_size_per_step=32, params=model.parameters(), optimizer=INNER[inner_name],
                              matchmaking_time=1.0, averaging_timeout=30.0)
    try:
        t_var, t_base = timed_pairs(opt.step, bare.step, reps, warmup)
        assert opt.local_epoch == 0 and opt.last_round is None, "a round happened: the target batch is not huge enough"
    finally:
        opt.shutdown()
    out["variants"]["swarm_opt"] = {"step_us": quantiles(t_var), "inner_us": quantiles(t_base)}
    del opt, model
    gc.collect()

    if with_metrics:
        import threading
        import urllib.request

        from swarm_opt.monitor.prometheus import serve_metrics

        model = make_model(model_name)
        opt = swarm_opt.Optimizer(dht=dht, run_id=f"metrics_{model_name}_{inner_name}", target_batch_size=HUGE_TARGET,
                                  batch_size_per_step=32, params=model.parameters(), optimizer=INNER[inner_name],
                                  matchmaking_time=1.0, averaging_timeout=30.0)
        metrics = serve_metrics(opt, 0, host="127.0.0.1")
        url = f"http://127.0.0.1:{metrics._server[0].server_address[1]}/metrics"
        done = threading.Event()

        def scrape() -> None:
            while not done.wait(0.5):
                with urllib.request.urlopen(url, timeout=5) as response:
                    response.read()

        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
        try:
            t_var, t_base = timed_pairs(opt.step, bare.step, reps, warmup)
        finally:
            done.set()
            scraper.join(5)
            metrics.close()
            opt.shutdown()
        out["variants"]["swarm_opt+metrics"] = {"step_us": quantiles(t_var), "inner_us": quantiles(t_base)}
        del opt, model
        gc.collect()

    if not skip_hivemind:
        model = make_model(model_name)
        hopt = hivemind.Optimizer(dht=dht, run_id=f"hm_overhead_{model_name}_{inner_name}",
                                  target_batch_size=HUGE_TARGET, batch_size_per_step=32, params=model.parameters(),
                                  optimizer=INNER[inner_name], use_local_updates=False, matchmaking_time=3.0,
                                  averaging_timeout=30.0, verbose=False)
        try:
            t_var, t_base = timed_pairs(hopt.step, bare.step, reps, warmup)
            assert hopt.local_epoch == 0, "hivemind ran a round: the target batch is not huge enough"
        finally:
            hopt.shutdown()
        out["variants"]["hivemind"] = {"step_us": quantiles(t_var), "inner_us": quantiles(t_base)}
        del hopt, model
        gc.collect()

    for v in out["variants"].values():
        v["ratio_to_inner"] = v["step_us"]["median"] / v["inner_us"]["median"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["small", "large"], choices=sorted(MODELS))
    parser.add_argument("--inner", nargs="+", default=["sgd", "adam"], choices=sorted(INNER))
    parser.add_argument("--reps-small", type=int, default=3000, help="timed pairs per variant for the small model")
    parser.add_argument("--reps-large", type=int, default=150, help="timed pairs per variant for the large model")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--skip-hivemind", action="store_true")
    parser.add_argument("--skip-metrics", action="store_true", help="skip the swarm_opt+metrics variant")
    parser.add_argument("--out", default="step_overhead.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)

    import hivemind

    import swarm_opt  # noqa: F401  (tames hivemind's logging before the DHT starts)

    print(f"command: {command_line()}")
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    results = []
    try:
        for model_name in args.models:
            for inner_name in args.inner:
                reps = args.reps_small if model_name == "small" else args.reps_large
                started = time.monotonic()
                r = bench_config(model_name, inner_name, dht, reps, args.warmup, args.skip_hivemind,
                                 not args.skip_metrics)
                print(f"  {model_name}/{inner_name} done in {time.monotonic() - started:.1f} s", flush=True)
                results.append(r)
    finally:
        dht.shutdown()

    rows = []
    for r in results:
        for name, v in r["variants"].items():
            s, b = v["step_us"], v["inner_us"]
            rows.append([f"{r['params'] / 1e6:.2f}M", r["inner"], name, f"{s['median']:.1f}", f"{s['iqr']:.1f}",
                         f"{b['median']:.1f}", f"{b['iqr']:.1f}", f"{v['ratio_to_inner']:.3f}x", r["reps"]])
    print()
    print(table(["params", "inner", "optimizer", "step() median us", "IQR us", "inner.step() median us",
                 "IQR us", "ratio", "pairs"], rows))
    path = write_json(args.out, {"benchmark": "step_overhead", "goal_ratio": 1.03, "results": results})
    print(f"\nwrote {path}\nreproduce: {command_line()}")


if __name__ == "__main__":
    main()
