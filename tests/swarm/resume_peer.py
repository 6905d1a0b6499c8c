"""A single deterministic peer that checkpoints every epoch and can crash itself (SIGKILL) mid-run.

``python resume_peer.py STRATEGY EPOCHS CKPT_DIR OUT [KILL_AT_STEP]``: trains until EPOCHS global epochs, resuming
from CKPT_DIR if it holds a checkpoint; with KILL_AT_STEP it SIGKILLs itself after that many steps.
"""

from __future__ import annotations

import gc
import os
import signal
import sys

import torch


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def main(strategy_name: str, epochs: int, ckpt_dir: str, out: str, kill_at: int = -1) -> None:
    import hivemind

    import swarm_opt
    from tests.swarm.peer import make_strategy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    inner = (lambda p: torch.optim.AdamW(p, lr=1e-2)) if strategy_name == "diloco" else \
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    opt = swarm_opt.Optimizer(
        dht=dht, run_id=f"resume_{os.getpid()}", target_batch_size=64, batch_size_per_step=16,
        params=model.parameters(), optimizer=inner, strategy=make_strategy(strategy_name),
        matchmaking_time=1.0, averaging_timeout=5.0,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.7))
    ckpt = swarm_opt.Checkpointer(ckpt_dir, every_epochs=1, keep_last=2)
    restored = ckpt.restore(opt, model)
    step = restored["extra"]["step"] if restored else 0
    while opt.local_epoch < epochs:
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        ckpt.maybe_save(opt, model, extra={"step": step})
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save([p.detach().clone() for p in model.parameters()], out)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], *(int(a) for a in sys.argv[5:]))
    gc.freeze()  # skips the interpreter's final collection of torch's modules (~1 s at exit); nothing left needs it
