"""Memory that one swarm_opt peer needs beyond the model and its inner optimizer, per strategy.

One peer (rounds run solo: nothing is sent, so the averager's all-reduce working memory is not included), an MLP
784-2800-2800-10 (10.07M fp32 parameters, 40.3 MB), inner optimizer SGD(momentum=0.9) for every strategy (Scaffold
only accepts SGD), ``target_batch_size=64``, 16 samples per step. Each strategy runs in a fresh process
(``--worker``), so that allocator state from one strategy does not leak into the next.

Two views, both as multiples of the parameter bytes:

* **tensors** (exact): the bytes of tensors that swarm_opt owns in the user process — every tensor reachable from
  the strategy's attributes (except the parameters), the outer optimizer's state (DiLoCo), and hivemind's shared
  averaging buffers ``opt._averager._engine._averaged_tensors`` — deduplicated by storage.
* **process** (what the OS sees): ``/proc/<pid>/smaps_rollup`` of the user process before the Optimizer exists (model
  built, one backward done: parameters and gradients allocated) and after two full rounds (plus one more backward,
  so gradients exist again), and of the averager child process that swarm_opt starts. Reported: RSS, USS
  (Private_Clean + Private_Dirty), and *anon+shm PSS* (Pss_Anon + Pss_Shmem: anonymous and shared memory, each page
  split between the processes that map it, so the sum over processes counts every page once). The peak is the user
  process's VmHWM after resetting it (``echo 5 > /proc/self/clear_refs``) just before the Optimizer is created.
  Extra = Δ(user anon+shm PSS) + averager anon+shm PSS − inner-optimizer state bytes.

    python benchmarks/memory.py
    python benchmarks/memory.py --strategies grad scaffold
    python benchmarks/memory.py --malloc-mmap-threshold 1048576 --tag _mmap   # without glibc's heap retention
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict

from _common import RESULTS_DIR, STRATEGIES, kill_all, launch, leftovers, table, tail, write_json

from swarm_opt._procfs import memory_rollup

# the goals, per strategy (benchmarks/README.md, memory.py)
GOALS = {"grad": 2.0, "local": 2.0, "fedprox": 2.0, "scaffold": 3.0, "diloco": 3.0}
MB = 1e6


def smaps(pid: int) -> Dict[str, int]:
    """Fields of /proc/<pid>/smaps_rollup in bytes, plus VmHWM/VmRSS from /proc/<pid>/status."""
    out = memory_rollup(pid)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmHWM", "VmRSS")):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def tensor_bytes(t) -> int:
    return t.untyped_storage().nbytes()


def collect_tensors(obj: Any, name: str, found: Dict[str, list], depth: int = 0) -> None:
    import torch

    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        found.setdefault(name, []).append(obj)
        if obj.grad is not None:
            found.setdefault(name + ".grad", []).append(obj.grad)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            collect_tensors(v, name, found, depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():  # Scaffold keys its dicts by the parameters themselves: values only
            collect_tensors(v, name, found, depth + 1)
    elif isinstance(obj, torch.optim.Optimizer):
        collect_tensors(dict(obj.state), name + ".state", found, depth + 1)


def swarm_opt_tensors(opt) -> Dict[str, int]:
    """Bytes per owner of every tensor swarm_opt holds in this process, each storage counted once."""
    # the parameters and their gradients belong to the model (Scaffold's _groups lists hold the parameters)
    param_storages = {t.untyped_storage().data_ptr() for p in opt._params for t in (p, p.grad) if t is not None}
    found: Dict[str, list] = {}
    for attr, value in vars(opt.strategy).items():
        if attr in ("params", "inner"):
            continue
        collect_tensors(value, f"strategy.{attr}", found)
    collect_tensors(list(opt._averager._engine._averaged_tensors), "averager._averaged_tensors (shared memory)",
                    found)
    seen = set(param_storages)
    sizes: Dict[str, int] = {}
    for name, tensors in found.items():
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            sizes[name] = sizes.get(name, 0) + tensor_bytes(t)
    return sizes


def worker(args: argparse.Namespace) -> None:
    import logging

    import hivemind
    import torch

    import swarm_opt

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)  # a light neighbour for the timing benchmarks that may run beside it
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)  # before the model: it forks

    torch.manual_seed(0)
    h = args.hidden
    model = torch.nn.Sequential(torch.nn.Linear(784, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                                torch.nn.ReLU(), torch.nn.Linear(h, 10))
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    x, y = torch.randn(16, 784), torch.randint(0, 10, (16,))

    def backward() -> None:
        for p in params:
            p.grad = None
        torch.nn.functional.cross_entropy(model(x), y).backward()

    backward()
    backward()
    # the first torch.optim optimizer imports torch._dynamo & co. (~70 MB, 1.8x these parameters): a one-time cost
    # of torch, not of swarm_opt, so it is paid before the baseline
    warm = torch.nn.Parameter(torch.zeros(4))
    warm.grad = torch.ones(4)
    torch.optim.SGD([warm], lr=0.1, momentum=0.9).step()
    gc.collect()
    me = os.getpid()
    before = smaps(me)
    Path(f"/proc/{me}/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    hwm_reset = smaps(me)["VmHWM"]

    strategy = STRATEGIES[args.strategy].make()
    opt = swarm_opt.Optimizer(dht=dht, run_id=f"memory_{args.strategy}_{me}", target_batch_size=64,
                              batch_size_per_step=16, params=params, strategy=strategy,
                              optimizer=lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
                              matchmaking_time=1.0, averaging_timeout=15.0)
    child = opt._averager._engine.pid
    after_init = smaps(me)
    child_after_init = smaps(child)
    deadline = time.monotonic() + 120
    steps = 0
    while opt.local_epoch < args.rounds and time.monotonic() < deadline:
        backward()
        opt.step()
        steps += 1
    assert opt.local_epoch >= args.rounds, f"only {opt.local_epoch} rounds in 120 s"
    backward()  # gradients allocated again, as in the `before` snapshot
    gc.collect()
    after = smaps(me)
    child_after = smaps(child)
    inner_state = sum(tensor_bytes(v) for s in opt.inner.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor))
    owned = swarm_opt_tensors(opt)
    result = {
        "strategy": args.strategy, "param_bytes": param_bytes, "params": sum(p.numel() for p in params),
        "inner_state_bytes": inner_state, "rounds": opt.local_epoch, "steps": steps,
        "last_round": None if opt.last_round is None else opt.last_round.__dict__,
        "tensors": owned, "tensors_total": sum(owned.values()),
        "user_before": before, "user_after_init": after_init, "user_after": after, "hwm_at_reset": hwm_reset,
        "averager_after_init": child_after_init, "averager_after": child_after, "averager_pid": child,
        "averager_cmdline": Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200],
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    opt.shutdown()
    dht.shutdown()
    os._exit(0)


def summarize(r: Dict[str, Any]) -> Dict[str, Any]:
    pb, inner = r["param_bytes"], r["inner_state_bytes"]
    ub, ua, ca = r["user_before"], r["user_after"], r["averager_after"]
    d = {k: ua[k] - ub[k] for k in ("Rss", "USS", "anon")}
    extra_process = d["anon"] + ca["anon"] - inner
    peak_user = r["user_after"]["VmHWM"] - ub["Rss"]
    biggest = sorted(r["tensors"].items(), key=lambda kv: -kv[1])
    return {
        "strategy": r["strategy"], "goal_x": GOALS[r["strategy"]],
        "tensors_x": r["tensors_total"] / pb,
        "tensors_by_owner_x": {k: v / pb for k, v in biggest},
        "user_delta_rss_x": (d["Rss"] - inner) / pb, "user_delta_uss_x": (d["USS"] - inner) / pb,
        "user_delta_anon_shm_pss_x": (d["anon"] - inner) / pb,
        "user_peak_x": (peak_user - inner) / pb,
        "averager_rss_x": ca["Rss"] / pb, "averager_uss_x": ca["USS"] / pb,
        "averager_anon_shm_pss_x": ca["anon"] / pb,
        "averager_uss_after_init_x": r["averager_after_init"]["USS"] / pb,
        "averager_uss_MB": ca["USS"] / MB,
        "process_extra_x": extra_process / pb,
        "process_extra_MB": extra_process / MB,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="grad")
    p.add_argument("--out", default="")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2800, help="MLP 784-h-h-10; 2800 = 10.07M parameters")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    p.add_argument("--malloc-mmap-threshold", type=int, default=0,
                   help="set MALLOC_MMAP_THRESHOLD_ in the workers (e.g. 1048576): every large tensor is then mmapped "
                        "and returned to the OS when freed, which separates live memory from glibc's retention")
    p.add_argument("--tag", default="", help="suffix of the result file: memory<tag>.json")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logdir = RESULTS_DIR / "memory_logs"
    logdir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    raw, summaries = [], []
    for name in args.strategies:
        out, log = logdir / f"{name}{args.tag}.json", logdir / f"{name}{args.tag}.log"
        out.unlink(missing_ok=True)
        env = {"MALLOC_MMAP_THRESHOLD_": str(args.malloc_mmap_threshold)} if args.malloc_mmap_threshold else {}
        proc = launch([__file__, "--worker", "--strategy", name, "--out", str(out), "--rounds", str(args.rounds),
                       "--hidden", str(args.hidden)],
                      log, env_extra=env)
        try:
            proc.wait(240)
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill_all([proc])
            left = leftovers([proc])
            if left:
                print(f"WARNING: processes left behind: {left}", file=sys.stderr)
        if not out.exists():
            print(f"{name}: failed, log tail:\n{tail(log)}", flush=True)
            continue
        r = json.loads(out.read_text())
        raw.append(r)
        s = summarize(r)
        summaries.append(s)
        print(f"{name}: tensors {s['tensors_x']:.2f}x, process extra {s['process_extra_x']:.2f}x "
              f"({s['process_extra_MB']:.0f} MB), user peak {s['user_peak_x']:.2f}x", flush=True)

    if not raw:
        sys.exit("no strategy finished")
    pb = raw[0]["param_bytes"]
    rows = []
    for s in summaries:
        owners = ", ".join(f"{k.split(' ')[0].replace('strategy.', '')} {v:.1f}"
                           for k, v in s["tensors_by_owner_x"].items())
        # what grows with the model: tensors and the user process's peak; the averager process holds a fixed amount
        # (its copy of the Python heap, ~96 MB here, the same at 10M and 40M parameters), reported beside it
        worst = max(s["tensors_x"], s["user_peak_x"])
        verdict = "ok" if worst <= s["goal_x"] + 0.05 else f"over by {worst - s['goal_x']:.2f}x"
        rows.append([s["strategy"], f"{s['goal_x']:.0f}x", f"{s['tensors_x']:.2f}x", owners,
                     f"{s['user_delta_rss_x']:.2f}x", f"{s['user_delta_uss_x']:.2f}x", f"{s['user_peak_x']:.2f}x",
                     f"{s['averager_rss_x']:.2f}x", f"{s['averager_uss_x']:.2f}x ({s['averager_uss_MB']:.0f} MB)",
                     f"{s['process_extra_x']:.2f}x", verdict])
    headers = ["strategy", "goal", "swarm_opt tensors", "tensors by owner (x params)", "user dRSS", "user dUSS",
               "user peak", "averager RSS", "averager USS", "process extra (anon+shm PSS)", "vs goal (tensors, peak)"]
    print(f"params {raw[0]['params']:,} = {pb / MB:.1f} MB; inner SGD momentum state "
          f"{raw[0]['inner_state_bytes'] / MB:.1f} MB subtracted")
    print(table(headers, rows))
    path = write_json(f"memory{args.tag}.json", {"args": {k: v for k, v in vars(args).items() if k != "worker"},
                                      "loadavg_at_start": load_start, "summary": summaries, "raw": raw})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
