"""The soak's task: scikit-learn's digits with a wider MLP (64-1024-1024-10, 1.12M parameters, 4.5 MB in fp32).

The built-in ``digits`` model has 2,410 parameters: a buffer kept per failed round (hivemind #264's leak) would grow
by kilobytes an hour and hide in the noise. With 4.5 MB per copy, one leaked copy per failed round shows within
minutes, while a step stays cheap enough for five peers on two cores.

    swarm-opt train --task benchmarks/soak_task.py:make_task ...
"""

from __future__ import annotations

import torch

from swarm_opt.cli.tasks import Task, digits

WIDTH = 1024


def make_task() -> Task:
    base = digits()
    model = torch.nn.Sequential(torch.nn.Linear(64, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.ReLU(), torch.nn.Linear(WIDTH, 10))
    return Task(model, base.train_dataset, base.test_dataset, base.loss_fn)
