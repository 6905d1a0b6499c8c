"""A test peer: trains a small MLP on a deterministic shard of synthetic data and records what it did.

Run as ``python peer.py CONFIG.json``; writes CONFIG["out"] (torch.save) with the final parameters, the batches it
committed to each epoch, and its round reports. Every choice comes from the JSON config so tests stay declarative.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def make_data(seed: int = 0, n: int = 4096, dim: int = 16, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return x, y


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dtype)


def make_inner(name: str):
    if name == "adam":
        # eps well above float32 round-off: Adam divides by |g|, so tiny gradients amplify summation-order noise
        return lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-6)
    return lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)


def main(config_path: str) -> None:
    import logging

    import hivemind

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    import swarm_opt

    cfg = json.load(open(config_path))
    dht = hivemind.DHT(
        initial_peers=cfg.get("initial_peers", []), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        client_mode=cfg.get("client_mode", False), start=True,
    )
    with open(cfg["out"] + ".maddrs", "w") as f:
        json.dump([str(a) for a in dht.get_visible_maddrs()], f)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.get("dtype", "float32")]
    model = make_model(dtype)
    opt = swarm_opt.Optimizer(
        dht=dht, run_id=cfg.get("run_id", "test_run"), target_batch_size=cfg["target_batch_size"],
        batch_size_per_step=cfg["batch_size"], params=model.parameters(), optimizer=make_inner(cfg["inner"]),
        scheduler=(lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)) if cfg.get("scheduler") else None,
        matchmaking_time=cfg.get("matchmaking_time", 1.0), averaging_timeout=cfg.get("averaging_timeout", 15.0),
    )
    wait_until = time.monotonic() + 30
    while opt.progress.num_peers < cfg.get("expect_peers", 1) and time.monotonic() < wait_until:
        time.sleep(0.05)
    x, y = make_data()
    rank, bs = cfg["rank"], cfg["batch_size"]
    g = torch.Generator().manual_seed(1000 + rank)
    committed, pending, reports, lrs = {}, [], [], {}
    last_report = None
    deadline = time.monotonic() + cfg.get("max_seconds", 120)
    while opt.local_epoch < cfg["epochs"] and time.monotonic() < deadline:
        idx = torch.randint(0, len(x), (bs,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx].to(dtype)).float(), y[idx])
        loss.backward()
        opt.step()
        pending.append(idx.tolist())
        if opt.last_round is not last_report:
            last_report = opt.last_round
            reports.append(last_report.__dict__)
            if not last_report.caught_up:
                committed[last_report.epoch] = pending
            pending = []
            lrs[opt.local_epoch] = opt.param_groups[0]["lr"]
        time.sleep(cfg.get("step_sleep", 0.01))
    result = dict(
        rank=rank, epoch=opt.local_epoch, committed=committed, reports=reports, lrs=lrs,
        params=[p.detach().clone() for p in model.parameters()],
    )
    torch.save(result, cfg["out"] + ".tmp")
    os.replace(cfg["out"] + ".tmp", cfg["out"])
    # stay a donor for a moment so that slower peers can still catch up from us
    linger_until = time.monotonic() + cfg.get("linger", 60.0)
    while time.monotonic() < linger_until and not os.path.exists(cfg["out"] + ".stop"):
        time.sleep(0.1)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
