"""A peer whose local steps are Opacus DP-SGD steps (``swarm_opt.OpacusPrivacy``). Run as ``python dp_peer.py
CONFIG.json``; writes CONFIG["out"] (torch.save) with, for every round it committed, the DP steps taken so far, the ε it
reported and its parameters."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SAMPLES, FEATURES, BATCH = 128, 10, 32
NOISE, MAX_GRAD_NORM, DELTA = 1.0, 1.0, 1e-5


def private_data(rank: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(700 + rank)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] + 0.3 * rank > 0).long())


def main(config_path: str) -> None:
    import hivemind

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # before swarm_opt
    from opacus import PrivacyEngine

    import swarm_opt
    from swarm_opt import testing
    from tests.swarm.peer import make_strategy

    # Opacus's own advice (secure RNG off: fine for tests) and torch's note about its backward hooks on a first layer
    # without input gradients; neither is swarm_opt's
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    cfg = json.load(open(config_path))
    dht = hivemind.DHT(initial_peers=testing.initial_peers(cfg), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    testing.write_addresses(dht.get_visible_maddrs(), cfg["out"] + ".maddrs")

    torch.manual_seed(0)  # the same initial model on every peer
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    engine = PrivacyEngine(accountant="rdp")
    loader = torch.utils.data.DataLoader(private_data(cfg["rank"]), batch_size=BATCH)
    model, dp_sgd, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.5)), data_loader=loader,
        noise_multiplier=NOISE, max_grad_norm=MAX_GRAD_NORM)
    privacy = swarm_opt.OpacusPrivacy(engine, delta=DELTA)
    opt = swarm_opt.Optimizer(dht=dht, run_id="dp_run", target_batch_size=cfg["target_batch_size"],
                              optimizer=dp_sgd, strategy=make_strategy(cfg["strategy"]), privacy=privacy,
                              matchmaking_time=cfg.get("matchmaking_time", 2.0), averaging_timeout=15.0)
    wait_until = time.monotonic() + 30
    while opt.progress.num_peers < cfg["expect_peers"] and time.monotonic() < wait_until:
        time.sleep(0.05)
    rounds, last, steps = [], None, 0
    deadline = time.monotonic() + 120
    while opt.local_epoch < cfg["epochs"] and time.monotonic() < deadline:
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step(batch_size=dp_sgd.expected_batch_size)  # not len(x): see swarm_opt.privacy
            steps += 1
            if opt.last_round is not last:
                last = opt.last_round
                rounds.append(dict(epoch=opt.local_epoch, group_size=last.group_size, steps=steps,
                                   epsilon=opt.progress.epsilon,  # Optimizer.progress reports it
                                   params=[p.detach().clone() for p in model.parameters()]))
            time.sleep(0.02)
            if opt.local_epoch >= cfg["epochs"]:
                break
    torch.save(dict(rounds=rounds, steps=steps, epsilon=privacy.epsilon(), sample_rate=1 / len(loader)),
               cfg["out"] + ".tmp")
    os.replace(cfg["out"] + ".tmp", cfg["out"])
    linger_until = time.monotonic() + 60
    while time.monotonic() < linger_until and not os.path.exists(cfg["out"] + ".stop"):
        time.sleep(0.1)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    gc.freeze()  # skips the interpreter's final collection of torch's modules (~1 s at exit); nothing left needs it
